"""nll_loss(input, target, weight=None, ignore_index=-100, reduction="mean").

The class dim is dim 1 of the input (dim 0 for 1-D input); the target has the input's other
dims. Per mesh dim:

* a shard of a non-class dim (the batch, or a spatial dim) of the input or the target stays, and
  the other one takes the same shard (a local slice when it was replicated);
  reduction "none": the output keeps it; "sum": each rank's sum is a ``Partial(sum)`` piece;
  "mean": each rank divides its weighted sum by the GLOBAL weight of the non-ignored targets (one
  small all-reduce of a value that does not depend on the input, so no gradient crosses it):
  ``Partial(sum)`` again, exact for uneven shards and for ignored targets.
* a shard of the class dim is gathered (``loss_parallel`` covers vocab-parallel cross entropy).
* the loss is linear in the input: a Partial(sum / avg) input with a replicated target stays
  Partial.
The legacy ``size_average`` / ``reduce`` arguments take the replicated path.
"""
from typing import Any
from hyper_parallel.core.dtensor.ops.registry import OpStrategy, register_rule
from hyper_parallel.core.dtensor.placement_types import Partial, Replicate
from hyper_parallel.platform import get_platform

_ARGS = ("input", "target", "weight", "size_average", "ignore_index", "reduce", "reduction")
_DEFAULTS = {"ignore_index": -100, "reduction": "mean"}


def _values(args, kwargs):
    return {name: (args[i] if i < len(args) else kwargs.get(name, _DEFAULTS.get(name)))
            for i, name in enumerate(_ARGS)}


def _placements(xs, ts, cdim, reduction):
    """Per mesh dim: (input, target, output) placements."""
    out = []
    for px, pt in zip(xs.placements, ts.placements):
        if px.is_shard() and px.dim != cdim:
            shard_x, shard_t = px, px.with_dim(px.dim if px.dim < cdim else px.dim - 1)
        elif pt.is_shard() and not px.is_partial():
            shard_t, shard_x = pt, pt.with_dim(pt.dim if pt.dim < cdim else pt.dim + 1)
        else:
            shard_x = None
        if shard_x is not None:
            done = shard_t if reduction == "none" else Partial("sum")
            out.append((shard_x, shard_t, done))
        elif px.is_partial() and px.reduce_op in ("sum", "avg"):
            out.append((px, Replicate(), px))
        else:
            out.append((Replicate(), Replicate(), Replicate()))
    return out


@register_rule("nll_loss")
def nll_loss_rule(call: Any) -> Any:
    v = _values(call.args, call.kwargs)
    x, t, w = v["input"], v["target"], v["weight"]
    xs, ts = call.spec(x), call.spec(t)
    plain = v["size_average"] is None and v["reduce"] is None and v["reduction"] in ("none", "sum", "mean")
    rep = (Replicate(),) * call.mesh_ndim
    if xs is None or ts is None or xs.ndim < 2 or not plain or ts.ndim != xs.ndim - 1:
        return OpStrategy(inputs=[rep] * len(call.specs), outputs=rep)
    per_dim = _placements(xs, ts, 1, v["reduction"])
    inputs = [None] * len(call.specs)
    inputs[call.index(x)] = tuple(p[0] for p in per_dim)
    inputs[call.index(t)] = tuple(p[1] for p in per_dim)
    if call.index(w) is not None:
        inputs[call.index(w)] = rep
    split = [m for m, p in enumerate(per_dim) if p[0].is_shard()]
    local = None
    if v["reduction"] == "mean" and split:
        local = _mean_local(call.mesh, split)
    return OpStrategy(inputs=inputs, outputs=tuple(p[2] for p in per_dim), local=local)


def _mean_local(mesh, mesh_dims):
    platform = get_platform()

    def nll_mean_over_shards(call, args, kwargs):
        v = _values(args, kwargs)
        x, t, w = v["input"], v["target"], v["weight"]
        w = None if w is None else w.detach()
        total = call.func(x, t, w, ignore_index=v["ignore_index"], reduction="sum")
        with platform.no_grad():  # the global weight of the counted targets: -x_t = 1 everywhere
            count = call.func(x.detach().new_full(tuple(x.shape), -1.0), t, w, ignore_index=v["ignore_index"],
                              reduction="sum")
            for m in mesh_dims:
                count = platform.all_reduce(count.contiguous(), mesh.get_group(m), "sum")
        return total / count
    return nll_mean_over_shards


__all__ = ["nll_loss_rule"]
