"""Shape ops: view / reshape / flatten / unflatten / squeeze / unsqueeze, expand, and the
dim permutations (transpose, permute, movedim, t).

A reshape keeps a shard when the sharded dim is the outermost of the dims it merges into or
splits from, and the split stays even; otherwise that mesh dim is gathered first.
"""
from typing import Any
import math

from hyper_parallel.core.dtensor.ops.registry import OpStrategy, register_rule
from hyper_parallel.core.dtensor.placement_types import Replicate, StridedShard
from hyper_parallel.core.dtensor.layout import local_box
from hyper_parallel.platform import get_platform


def reshape_groups(in_shape: Any, out_shape: Any) -> Any:
    """Pair runs of input dims with runs of output dims of equal product."""
    groups: list[Any] = []
    i, j = 0, 0
    n_in, n_out = len(in_shape), len(out_shape)
    while i < n_in or j < n_out:
        if i < n_in and in_shape[i] == 1 and (j >= n_out or out_shape[j] != 1):
            groups.append(([i], []))
            i += 1
            continue
        if j < n_out and out_shape[j] == 1 and (i >= n_in or in_shape[i] != 1):
            groups.append(([], [j]))
            j += 1
            continue
        gi, gj = [i], [j]
        pi, pj = in_shape[i], out_shape[j]
        while pi != pj:
            if pi < pj:
                i += 1
                gi.append(i)
                pi *= in_shape[i]
            else:
                j += 1
                gj.append(j)
                pj *= out_shape[j]
        groups.append((gi, gj))
        i += 1
        j += 1
    return groups


def _shards_of(placements, dim, mesh):
    return math.prod(mesh.size(m) for m, p in enumerate(placements) if p.is_shard(dim))


def reshape_placements(spec: Any, out_shape: Any, mesh: Any) -> Any:
    """(input placements, output placements) for reshaping ``spec`` to ``out_shape``."""
    groups = reshape_groups(spec.shape, out_shape)
    where = {}
    for gi, gj in groups:
        for pos, d in enumerate(gi):
            where[d] = (pos, gi, gj)
    inputs, outputs = [], []
    for m, p in enumerate(spec.placements):
        if not p.is_shard():
            inputs.append(p)
            outputs.append(p)
            continue
        pos, gi, gj = where[p.dim]
        n = _shards_of(spec.placements, p.dim, mesh)
        keeps = pos == 0 and gj and (len(gi) == 1 and len(gj) == 1 or
                                     (not isinstance(p, StridedShard) and
                                      spec.shape[gi[0]] % n == 0 and out_shape[gj[0]] % n == 0))
        if keeps:
            inputs.append(p)
            outputs.append(p.with_dim(gj[0]))
        else:
            inputs.append(Replicate())
            outputs.append(Replicate())
    return tuple(inputs), tuple(outputs)


def _local_shape(mesh, placements, shape):
    return tuple(s for _, s in local_box(shape, placements, mesh.mesh_shape, mesh.get_coordinate()))


@register_rule("view")
def view_rule(call: Any) -> Any:
    src = call.specs[0] if call.index(call.args[0]) == 0 else None
    if src is None:
        return None
    out_shape = call.out_shapes[0]
    inputs, outputs = reshape_placements(src, out_shape, call.mesh)
    local_out = _local_shape(call.mesh, outputs, out_shape)

    def view_local_piece(call_, args, kwargs):
        return args[0].reshape(local_out)
    return OpStrategy(inputs=[inputs] + [None] * (len(call.specs) - 1), outputs=outputs,
                      local=view_local_piece)


@register_rule("expand")
def expand_rule(call: Any) -> Any:
    src = call.specs[0]
    out_shape = call.out_shapes[0]
    lead = len(out_shape) - src.ndim
    inputs, outputs = [], []
    for p in src.placements:
        if p.is_shard() and src.shape[p.dim] == out_shape[p.dim + lead]:
            inputs.append(p)
            outputs.append(p.with_dim(p.dim + lead))
        else:
            inputs.append(Replicate() if p.is_shard() else p)
            outputs.append(Replicate() if p.is_shard() else p)
    local_out = _local_shape(call.mesh, tuple(outputs), out_shape)

    def expand_local_piece(call_, args, kwargs):
        return args[0].expand(local_out)
    return OpStrategy(inputs=[tuple(inputs)] + [None] * (len(call.specs) - 1), outputs=tuple(outputs),
                      local=expand_local_piece)


# ------------------------------------------------------------------------------ permutations
def _permutation(call, ndim):
    """out dim i comes from input dim perm[i]."""
    perm = list(range(ndim))
    if call.name == "t":
        return perm[::-1] if ndim == 2 else perm
    if call.name == "transpose":
        d0, d1 = call.arg(1, "dim0"), call.arg(2, "dim1")
        d0, d1 = d0 % ndim, d1 % ndim
        perm[d0], perm[d1] = perm[d1], perm[d0]
        return perm
    if call.name == "permute":
        dims = call.args[1:] if len(call.args) > 1 else call.kwargs["dims"]
        if len(dims) == 1 and isinstance(dims[0], (list, tuple)):
            dims = dims[0]
        return [d % ndim for d in dims]
    # movedim
    src, dst = call.arg(1, "source"), call.arg(2, "destination")
    src = [src] if isinstance(src, int) else list(src)
    dst = [dst] if isinstance(dst, int) else list(dst)
    src, dst = [s % ndim for s in src], [d % ndim for d in dst]
    rest = [d for d in range(ndim) if d not in src]
    out = [None] * ndim
    for s, d in zip(src, dst):
        out[d] = s
    it = iter(rest)
    return [o if o is not None else next(it) for o in out]


@register_rule("transpose", "permute", "movedim", "t")
def permute_rule(call: Any) -> Any:
    src = call.specs[0]
    perm = _permutation(call, src.ndim)
    outputs = tuple(p.with_dim(perm.index(p.dim)) if p.is_shard() else p for p in src.placements)
    return OpStrategy(inputs=[src.placements], outputs=outputs)


def _casts_to_floating(call):
    """Whether the cast's result is floating: asked of an empty piece of the shard (no meta run)."""
    empty = call.dtensors[0]._local_tensor.reshape(-1)[:0]
    rest = [a._local_tensor.reshape(-1)[:0] if call.index(a) is not None else a for a in call.args[1:]]
    return get_platform().is_floating_dtype(call.func(empty, *rest, **call.kwargs).dtype)


@register_rule("identity", "cast")
def identity_rule(call: Any) -> Any:
    """Copies and casts keep the layout. A Partial value survives a cast to a floating dtype (sums
    commute with it up to rounding) but not to an integer or bool one (truncating each piece is not
    truncating the sum): there it is reduced first."""
    src = call.specs[0]
    if call.index(call.args[0]) != 0:
        return None
    call.set_out_shapes([src.shape])  # a meta run cannot follow .to("cpu")
    placements = src.placements
    if any(p.is_partial() for p in placements) and call.name == "cast" and not _casts_to_floating(call):
        placements = tuple(Replicate() if p.is_partial() else p for p in placements)
    others = [s.placements if i else None for i, s in enumerate(call.specs)]
    return OpStrategy(inputs=[placements] + others[1:], outputs=placements)


@register_rule("view_as_real", "view_as_complex")
def complex_view_rule(call: Any) -> Any:
    """view_as_real appends a dim of 2 (real, imaginary); view_as_complex folds it away, so that dim
    must be whole. Other shards keep their dims, and a Partial stays Partial (both are linear)."""
    x = call.args[0] if call.args else call.kwargs.get("input")
    spec = call.spec(x)
    if spec is None or call.index(x) != 0 or len(call.specs) != 1:
        return None
    folds = call.name == "view_as_complex"
    inputs = tuple(Replicate() if folds and p.is_shard(spec.ndim - 1) else p for p in spec.placements)
    return OpStrategy(inputs=[inputs], outputs=inputs)


__all__ = ["reshape_groups", "reshape_placements"]
