"""var / std / var_mean / std_mean (``dim``, ``correction`` / ``unbiased``, ``keepdim``).

Shards of dims that are not reduced stay (moved to their output dim). A mesh dim that splits a
reduced dim does not gather it: the variance is computed exactly from per-rank moments, with the
same two passes torch makes on one device:

    S    = all_reduce_sum(sum_local x)              mean = S / N     (N: the GLOBAL count)
    M2   = all_reduce_sum(sum_local |x - mean|^2)
    var  = M2 / max(N - correction, 0)              std = sqrt(var)

Both all-reduces are the platform's differentiable one with an identity backward: var and mean
are Replicate on that mesh dim, so every rank already holds the whole gradient of each sum. The
variance pass uses the mean without its gradient (its derivative is ``sum (x - mean) = 0``, which
is how torch's own var backward treats it); var_mean's mean output keeps its gradient. Empty
(uneven, ``torch.chunk``) pieces add zero to both sums. ``std``'s gradient is zero where std is
zero, as torch's. A Partial input is reduced first (the variance is not linear).
"""
from typing import Any
from hyper_parallel.core.dtensor.ops.reductions import combined_reduction_layout, reduced_dims
from hyper_parallel.core.dtensor.ops.registry import OpStrategy, register_rule
from hyper_parallel.platform import get_platform


def parse_variance_args(args: Any, kwargs: Any) -> Any:
    """(dim, correction, keepdim) of var(x, dim=None, *, correction, keepdim), var(x, dim, unbiased,
    keepdim) or var(x, unbiased); None for a spelling this rule does not read."""
    rest = list(args[1:])
    dim, unbiased = kwargs.get("dim"), kwargs.get("unbiased")
    correction, keepdim = kwargs.get("correction"), kwargs.get("keepdim", False)
    if rest and isinstance(rest[0], bool):
        unbiased = rest.pop(0)
    elif rest:
        dim = rest.pop(0)
        if rest:
            unbiased = rest.pop(0)
        if rest:
            keepdim = rest.pop(0)
    if rest or (unbiased is not None and correction is not None):
        return None
    if dim is not None and not isinstance(dim, (int, list, tuple)):
        return None  # named dims
    if correction is None:
        correction = 0 if unbiased is False else 1
    return dim, correction, bool(keepdim)


@register_rule("var", "std", "var_mean", "std_mean")
def variance_rule(call: Any) -> Any:
    x = call.arg(0, "input")
    spec = call.spec(x)
    parsed = parse_variance_args(call.args, call.kwargs)
    if spec is None or call.index(x) != 0 or len(call.specs) != 1 or parsed is None:
        return None
    dim, correction, keepdim = parsed
    ndim = spec.ndim
    reduced = reduced_dims(dim, ndim)
    if any(len(s) != (ndim if keepdim else ndim - len(reduced)) for s in call.out_shapes):
        return None
    inputs, outputs, mesh_dims = combined_reduction_layout(spec, reduced, keepdim)
    local = None
    if mesh_dims:
        count = 1
        for d in reduced:
            count *= spec.shape[d]
        local = _moments_local(call.name, call.mesh, mesh_dims, reduced, keepdim, count, correction)
    return OpStrategy(inputs=[inputs], outputs=outputs, local=local)


def _moments_local(name, mesh, mesh_dims, reduced, keepdim, count, correction):
    platform = get_platform()

    def all_sum(t):
        for m in mesh_dims:
            t = platform.differentiable_all_reduce(t.contiguous(), mesh.get_group(m), "sum",
                                                   backward="identity")
        return t

    def merged_moments(call, args, kwargs):
        x = args[0]
        mean = all_sum(platform.local_sum(x, dim=reduced, keepdim=True)) / count
        d = x - platform.detach(mean)
        square = (d * d.conj()).real if x.is_complex() else d * d
        var = all_sum(platform.local_sum(square, dim=reduced, keepdim=keepdim)) / max(count - correction, 0)
        if name.startswith("std"):
            zero = var == 0
            var = var.masked_fill(zero, 1).sqrt().masked_fill(zero, 0)  # zero gradient at zero, as torch
        if not name.endswith("_mean"):
            return var
        return var, mean.reshape(var.shape)
    return merged_moments


__all__ = ["parse_variance_args", "variance_rule"]
