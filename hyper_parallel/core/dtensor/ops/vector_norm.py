"""linalg.vector_norm(x, ord=2, dim=None, keepdim=False, *, dtype=None).

Shards of dims that are not reduced stay. A mesh dim splitting a reduced dim is combined exactly
from per-rank pieces:

* finite ``ord >= 1``: ``(all_reduce_sum(sum_local |x|^ord))^(1/ord)``, the all-reduce with an
  identity backward (the norm is Replicate there). The gradient is torch's
  ``sgn(x) |x|^(ord-1) / norm^(ord-1)``, and zero where the norm is zero, as torch's.
* ``ord = +-inf``: the local max / min of ``|x|``, then an all-reduce max / min (the amax rule's
  collective: the gradient goes to the rank(s) holding the winning value).
* any other ord (0, fractional below 1, negative): the reduced dims are gathered.

A mesh dim leaving some rank an empty piece of a reduced dim is gathered (no local max).
A Partial input is reduced first.
"""
import math

from hyper_parallel.core.dtensor.ops.logsumexp import split_reduction_layout
from hyper_parallel.core.dtensor.ops.reductions import reduced_dims
from hyper_parallel.core.dtensor.ops.registry import OpStrategy, register_rule
from hyper_parallel.core.dtensor.ops.whole_dim import gather_dims
from hyper_parallel.platform import get_platform

_ARGS = ("x", "ord", "dim", "keepdim")


def _value(call, i, default):
    return call.args[i] if len(call.args) > i else call.kwargs.get(_ARGS[i], default)


@register_rule("vector_norm")
def vector_norm_rule(call):
    x = _value(call, 0, None)
    spec = call.spec(x)
    if spec is None or call.index(x) != 0 or len(call.specs) != 1:
        return None
    order, dim, keepdim = _value(call, 1, 2), _value(call, 2, None), bool(_value(call, 3, False))
    if not isinstance(order, (int, float)) or isinstance(order, bool) or "out" in call.kwargs:
        return None
    if dim is not None and (not isinstance(dim, (int, list, tuple)) or isinstance(dim, bool)):
        return None
    reduced = reduced_dims(dim, spec.ndim)
    if len(call.out_shapes[0]) != (spec.ndim if keepdim else spec.ndim - len(reduced)):
        return None
    combinable = math.isinf(order) or order >= 1
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

    def local(call, args, kwargs):
        x = args[0]
        dtype = kwargs.get("dtype")
        if dtype is not None:
            x = x.to(dtype)
        a = x.abs()
        if math.isinf(order):
            op = "max" if order > 0 else "min"
            extreme = a.amax if op == "max" else a.amin
            out = extreme(dim=reduced, keepdim=keepdim)
            for m in mesh_dims:
                out = platform.differentiable_all_reduce(out.contiguous(), mesh.get_group(m), op,
                                                         backward="identity")
            return out
        powered = a if order == 1 else a ** order
        s = platform.local_sum(powered, dim=reduced, keepdim=keepdim)
        for m in mesh_dims:
            s = platform.differentiable_all_reduce(s.contiguous(), mesh.get_group(m), "sum",
                                                   backward="identity")
        if order == 1:
            return s
        zero = s == 0
        return (s.masked_fill(zero, 1) ** (1.0 / order)).masked_fill(zero, 0)
    return local


__all__ = ["vector_norm_rule"]
