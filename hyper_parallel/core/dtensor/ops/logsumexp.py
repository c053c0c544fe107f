"""logsumexp(x, dim, keepdim=False).

Shards of dims that are not reduced stay. A mesh dim splitting a reduced dim is combined exactly,
as ring attention merges blocks:

    m   = all_reduce_max(max_local x)        (a constant shift: no gradient; 0 where it is +-inf,
                                              as torch's own kernel does)
    s   = all_reduce_sum(sum_local exp(x - m))
    out = log(s) + m

The sum's all-reduce has an identity backward (the output is Replicate on that mesh dim, so every
rank holds the whole gradient), after which the local gradient ``softmax(x)`` needs nothing more.
A rank whose piece of a reduced dim is empty (uneven shards) has no local max: that mesh dim is
gathered instead. A Partial input is reduced first.
"""
from typing import Any
from hyper_parallel.core.dtensor.ops.reductions import (
    _some_piece_empty, combined_reduction_layout, reduced_dims)
from hyper_parallel.core.dtensor.ops.registry import OpStrategy, register_rule
from hyper_parallel.core.dtensor.placement_types import Replicate
from hyper_parallel.platform import get_platform


def split_reduction_layout(spec: Any, reduced: Any, keepdim: Any) -> Any:
    """combined_reduction_layout, except that a split leaving some rank an empty piece of a reduced
    dim is gathered (that rank would have no local max)."""
    inputs, outputs, mesh_dims = combined_reduction_layout(spec, reduced, keepdim)
    if mesh_dims and _some_piece_empty(spec, inputs, sorted({spec.placements[m].dim for m in mesh_dims})):
        inputs = tuple(Replicate() if m in mesh_dims else p for m, p in enumerate(inputs))
        mesh_dims = []
    return inputs, outputs, mesh_dims


@register_rule("logsumexp")
def logsumexp_rule(call: Any) -> Any:
    x = call.arg(0, "input")
    spec = call.spec(x)
    dim = call.arg(1, "dim")
    if spec is None or call.index(x) != 0 or len(call.specs) != 1 or spec.ndim == 0:
        return None
    if not isinstance(dim, (int, list, tuple)) or isinstance(dim, bool):
        return None
    keepdim = bool(call.arg(2, "keepdim", False))
    reduced = reduced_dims(dim, spec.ndim)
    if len(call.out_shapes[0]) != (spec.ndim if keepdim else spec.ndim - len(reduced)):
        return None
    inputs, outputs, mesh_dims = split_reduction_layout(spec, reduced, keepdim)
    local = _merged_local(call.mesh, mesh_dims, reduced, keepdim) if mesh_dims else None
    return OpStrategy(inputs=[inputs], outputs=outputs, local=local)


def _merged_local(mesh, mesh_dims, reduced, keepdim):
    platform = get_platform()

    def merged_logsumexp(call, args, kwargs):
        x = args[0]
        shift = x.detach().amax(dim=reduced, keepdim=True)
        for m in mesh_dims:
            shift = platform.all_reduce(shift.contiguous(), mesh.get_group(m), "max")
        shift = shift.masked_fill(shift.isinf(), 0)
        s = platform.local_sum((x - shift).exp(), dim=reduced, keepdim=True)
        for m in mesh_dims:
            s = platform.differentiable_all_reduce(s.contiguous(), mesh.get_group(m), "sum",
                                                   backward="identity")
        out = s.log() + shift
        if keepdim:
            return out
        return platform.local_sum(out, dim=reduced, keepdim=False)  # drops the size-1 reduced dims
    return merged_logsumexp


__all__ = ["logsumexp_rule", "split_reduction_layout"]
