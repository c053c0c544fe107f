"""mse_loss(input, target, reduction="mean", weight=None): elementwise, then reduced.

The inputs take the elementwise rule's layout (broadcasting included; Partial inputs are reduced,
the square is not linear). Reduction "none" keeps that layout; "sum" makes each rank's sum a
``Partial(sum)`` piece on every mesh dim that splits the output; "mean" divides each rank's sum by
the GLOBAL element count (exact for uneven shards, empty pieces included). The legacy
``size_average`` / ``reduce`` arguments take the replicated path.
"""
from typing import Any
from hyper_parallel.core.dtensor.ops.elementwise import elementwise_strategy
from hyper_parallel.core.dtensor.ops.registry import OpStrategy, register_rule
from hyper_parallel.core.dtensor.placement_types import Partial, Replicate
from hyper_parallel.platform import get_platform

_ARGS = ("input", "target", "size_average", "reduce", "reduction", "weight")


def _values(args, kwargs):
    vals = {name: (args[i] if i < len(args) else kwargs.get(name)) for i, name in enumerate(_ARGS)}
    vals["reduction"] = vals["reduction"] or "mean"
    return vals


@register_rule("mse_loss")
def mse_loss_rule(call: Any) -> Any:
    v = _values(call.args, call.kwargs)
    operands = [call.spec(v[k]) for k in ("input", "target", "weight") if v[k] is not None]
    rep = (Replicate(),) * call.mesh_ndim
    plain = v["size_average"] is None and v["reduce"] is None and v["reduction"] in ("none", "sum", "mean")
    if any(s is None for s in operands) or len(operands) != len(call.specs) or not plain:
        return OpStrategy(inputs=[rep] * len(call.specs), outputs=rep)
    out_shape = get_platform().broadcast_shapes(*[s.shape for s in operands])
    inputs, out = elementwise_strategy("mse_loss", call.specs, [], out_shape, call.mesh_ndim)
    if v["reduction"] == "none":
        return OpStrategy(inputs=inputs, outputs=out)
    reduced = tuple(Partial("sum") if p.is_shard() else p for p in out)
    local = None
    if v["reduction"] == "mean" and any(p.is_shard() for p in out):
        count = 1
        for n in out_shape:
            count *= n
        local = _mean_local(count)
    return OpStrategy(inputs=inputs, outputs=reduced, local=local)


def _mean_local(count):
    def mse_mean_over_shards(call, args, kwargs):
        v = _values(args, kwargs)
        extra = {} if v["weight"] is None else {"weight": v["weight"]}
        return call.func(v["input"], v["target"], reduction="sum", **extra) / count
    return mse_mean_over_shards


__all__ = ["mse_loss_rule"]
