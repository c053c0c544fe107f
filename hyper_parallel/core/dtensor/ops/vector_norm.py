"""linalg.vector_norm(x, ord=2, dim=None, keepdim=False, *, dtype=None), and torch.norm / Tensor.norm
where they compute a vector norm.

Shards of dims that are not reduced stay. A mesh dim splitting a reduced dim is combined exactly
from per-rank pieces:

* finite ``ord >= 1``: ``(all_reduce_sum(sum_local |x|^ord))^(1/ord)``, the all-reduce with an
  identity backward (the norm is Replicate there). The gradient is torch's
  ``sgn(x) |x|^(ord-1) / norm^(ord-1)``, and zero where the norm is zero, as torch's.
* any other ord (0, fractional below 1, negative, ``+-inf``): the reduced dims are gathered. (An
  all-reduce max would do for ``inf``, but torch's gradient at a NaN input, which picks no element,
  is not what a per-rank max-and-route gives.)
A Partial input is reduced first.
"""
from typing import Any
import math

from hyper_parallel.core.dtensor.ops.logsumexp import split_reduction_layout
from hyper_parallel.core.dtensor.ops.reductions import reduced_dims
from hyper_parallel.core.dtensor.ops.registry import OpStrategy, register_aten, register_rule
from hyper_parallel.core.dtensor.ops.whole_dim import gather_dims
from hyper_parallel.platform import get_platform

_ARGS = ("x", "ord", "dim", "keepdim")


def _value(call, i, default):
    return call.args[i] if len(call.args) > i else call.kwargs.get(_ARGS[i], default)


@register_rule("vector_norm")
def vector_norm_rule(call: Any) -> Any:
    if "out" in call.kwargs:
        return None
    return _norm_strategy(call, _value(call, 0, None), _value(call, 1, 2), _value(call, 2, None),
                          bool(_value(call, 3, False)))


@register_rule("norm")
def norm_rule(call: Any) -> Any:
    """``torch.norm`` / ``Tensor.norm(p="fro", dim=None, keepdim=False)``: a vector norm whenever
    torch computes one (a number ``p``; ``"fro"`` over at most two dims is the 2-norm); matrix norms
    ("nuc", or "fro" over more dims) take the fallback."""
    x = call.arg(0, "input", call.kwargs.get("self"))
    p, dim = call.arg(1, "p", "fro"), call.arg(2, "dim")
    if call.kwargs.get("out") is not None:
        return None
    if isinstance(p, str):
        if p != "fro" or not (dim is None or isinstance(dim, int) or len(dim) <= 2):
            return None
        p = 2
    return _norm_strategy(call, x, 2.0 if p is None else p, dim, bool(call.arg(3, "keepdim", False)))


def _norm_strategy(call, x, order, dim, keepdim):
    spec = call.spec(x)
    if spec is None or call.index(x) != 0 or len(call.specs) != 1:
        return None
    if not isinstance(order, (int, float)) or isinstance(order, bool):
        return None
    if dim is not None and (not isinstance(dim, (int, list, tuple)) or isinstance(dim, bool)):
        return None
    reduced = reduced_dims(dim, spec.ndim)
    if len(call.out_shapes[0]) != (spec.ndim if keepdim else spec.ndim - len(reduced)):
        return None
    combinable = not math.isinf(order) and order >= 1
    if not combinable:
        inputs, outputs = gather_dims(spec, set(reduced), lambda d: _out_dim(d, reduced, keepdim))
        return OpStrategy(inputs=[inputs], outputs=outputs)
    inputs, outputs, mesh_dims = split_reduction_layout(spec, reduced, keepdim)
    local = _combined_local(call.mesh, mesh_dims, reduced, keepdim, order) if mesh_dims else None
    return OpStrategy(inputs=[inputs], outputs=outputs, local=local)


def _out_dim(d, reduced, keepdim):
    return d if keepdim else d - sum(1 for r in reduced if r < d)


def _combined_local(mesh, mesh_dims, reduced, keepdim, order):
    platform = get_platform()

    def combined_norm(call, args, kwargs):
        x = args[0]
        dtype = kwargs.get("dtype")
        if dtype is not None:
            x = x.to(dtype)
        a = x.abs()
        powered = a if order == 1 else a ** order
        s = platform.local_sum(powered, dim=reduced, keepdim=keepdim)
        for m in mesh_dims:
            s = platform.differentiable_all_reduce(s.contiguous(), mesh.get_group(m), "sum",
                                                   backward="identity")
        if order == 1:
            return s
        zero = s == 0
        return (s.masked_fill(zero, 1) ** (1.0 / order)).masked_fill(zero, 0)
    return combined_norm


__all__ = ["norm_rule", "vector_norm_rule"]

# the aten op (reached below autograd: matrix_norm, normalize, cosine_similarity) takes
# torch.linalg.vector_norm's arguments in the same positions
register_aten("vector_norm", "linalg_vector_norm")
