"""matmul / mm / bmm / linear.

Per mesh dim the candidates are: everything replicated; a shared batch dim split; A's rows split
(B replicated); B's columns split (A replicated); the contraction dim split on both, giving a
Partial(sum) output; or one Partial operand times a replicated one. The cheapest wins (see
strategy_search.py), so a shard already in place is kept and nothing moves when it need not.
"""
from typing import Any
from hyper_parallel.core.dtensor.layout import numel
from hyper_parallel.core.dtensor.ops.registry import OpStrategy, register_rule
from hyper_parallel.core.dtensor.ops.strategy_search import pick
from hyper_parallel.core.dtensor.placement_types import Partial, Replicate, Shard


def _shard(current, dim):
    """Shard(dim), keeping the current placement's kind when it already splits ``dim``."""
    return current if current.is_shard(dim) else Shard(dim)


def _common_kind(pa, ia, pb, ib):
    """One shard kind for a dim both operands split (a batch or the contraction dim): A's if it
    already splits it, else B's, else a plain Shard. Both must split alike (a StridedShard beside
    a plain Shard would pair rows of A with other rows of B)."""
    if ia is not None and pa.is_shard(ia):
        return pa
    if ib is not None and pb.is_shard(ib):
        return pb
    return Shard(0)


def _out_shard(sources, dim):
    for p in sources:
        if p.is_shard():
            return p.with_dim(dim)
    return Shard(dim)


class _Dims:
    """Where the batch, row, contraction and column dims of A @ B sit in A, B and the output."""

    def __init__(self, a_shape, b_shape, b_k, b_n, out_ndim):
        na, nb = len(a_shape), len(b_shape)
        self.a_shape, self.b_shape = a_shape, b_shape
        self.a_k = na - 1
        self.a_m = na - 2 if na > 1 else None
        self.b_k, self.b_n = b_k, b_n
        self.out_batch = out_ndim - (na > 1) - (b_n is not None)
        self.out_m = self.out_batch if na > 1 else None
        self.out_n = out_ndim - 1 if b_n is not None else None
        self.a_batch = max(na - 2, 0)
        self.b_batch = max(nb - 2, 0) if b_n is not None and b_k == nb - 2 else 0


def _candidates(dims, pa, pb, out_shape):
    cands = [([Replicate(), Replicate()], Replicate())]
    for i in range(dims.out_batch):
        ia = i - (dims.out_batch - dims.a_batch)
        ib = i - (dims.out_batch - dims.b_batch)
        a_has = ia >= 0 and dims.a_shape[ia] == out_shape[i]
        b_has = ib >= 0 and dims.b_shape[ib] == out_shape[i]
        if not (a_has or b_has):
            continue
        kind = _common_kind(pa, ia if a_has else None, pb, ib if b_has else None)
        ta = kind.with_dim(ia) if a_has else Replicate()
        tb = kind.with_dim(ib) if b_has else Replicate()
        cands.append(([ta, tb], _out_shard([ta, tb], i)))
    if dims.a_m is not None:
        ta = _shard(pa, dims.a_m)
        cands.append(([ta, Replicate()], ta.with_dim(dims.out_m)))
    if dims.b_n is not None:
        tb = _shard(pb, dims.b_n)
        cands.append(([Replicate(), tb], tb.with_dim(dims.out_n)))
    kind = _common_kind(pa, dims.a_k, pb, dims.b_k)
    cands.append(([kind.with_dim(dims.a_k), kind.with_dim(dims.b_k)], Partial("sum")))
    if pa.is_partial() and pa.reduce_op in ("sum", "avg"):
        cands.append(([pa, Replicate()], pa))
    if pb.is_partial() and pb.reduce_op in ("sum", "avg"):
        cands.append(([Replicate(), pb], pb))
    return cands


def _operand_placements(call, a_spec, b_spec, dims, out_shape):
    """Per mesh dim, the (a, b, output) placements the product runs in: the cheapest candidate."""
    inputs_a, inputs_b, out = [], [], []
    for m in range(call.mesh_ndim):
        pa, pb = a_spec.placements[m], b_spec.placements[m]
        (ta, tb), po = pick(_candidates(dims, pa, pb, out_shape), [pa, pb],
                            [numel(a_spec.shape), numel(b_spec.shape)], call.mesh.size(m))
        inputs_a.append(ta)
        inputs_b.append(tb)
        out.append(po)
    return tuple(inputs_a), tuple(inputs_b), tuple(out)


@register_rule("matmul", "rmatmul")
def matmul_rule(call: Any) -> Any:
    a, b = call.args[0], call.args[1]
    if call.name == "rmatmul":
        a, b = b, a
    a_spec, b_spec = call.spec(a), call.spec(b)
    if a_spec is None or b_spec is None or a_spec.ndim == 0 or b_spec.ndim == 0:
        return None
    out_shape = call.out_shapes[0]
    nb = b_spec.ndim
    dims = _Dims(a_spec.shape, b_spec.shape, b_k=0 if nb == 1 else nb - 2, b_n=None if nb == 1 else nb - 1,
                 out_ndim=len(out_shape))
    pa, pb, out = _operand_placements(call, a_spec, b_spec, dims, out_shape)
    inputs = [None] * len(call.specs)
    inputs[call.index(a)], inputs[call.index(b)] = pa, pb
    return OpStrategy(inputs=inputs, outputs=out)


@register_rule("linear")
def linear_rule(call: Any) -> Any:
    x, w, bias = call.arg(0, "input"), call.arg(1, "weight"), call.arg(2, "bias")
    x_spec, w_spec = call.spec(x), call.spec(w)
    if x_spec is None or w_spec is None or w_spec.ndim != 2:
        return None
    out_shape = call.out_shapes[0]
    # B = W^T: contraction is W's dim 1, columns are W's dim 0.
    dims = _Dims(x_spec.shape, w_spec.shape, b_k=1, b_n=0, out_ndim=len(out_shape))
    px, pw, out = _operand_placements(call, x_spec, w_spec, dims, out_shape)
    inputs = [None] * len(call.specs)
    inputs[call.index(x)], inputs[call.index(w)] = px, pw
    if call.index(bias) is not None:
        inputs[call.index(bias)] = tuple(_bias_placement(p, len(out_shape)) for p in out)
    return OpStrategy(inputs=inputs, outputs=out)


def _bias_placement(out, out_ndim):
    if out.is_shard(out_ndim - 1):
        return out.with_dim(0)
    if out.is_partial():
        return Partial(out.reduce_op)  # the bias is added once: kept on one rank, zero elsewhere
    return Replicate()
