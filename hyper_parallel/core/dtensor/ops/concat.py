"""cat / concat / concatenate and stack: every input is brought to one common layout.

Per mesh dim the common placement is chosen as:

1. a shard of a dim other than the cat dim, if some input has one (the one held by the most
   elements wins, so the big inputs do not move; replicated inputs take their slice locally,
   for free);
2. else ``Partial(op)`` if some inputs are Partial with one and the same reduce op (cat and
   stack only move data, so they commute with every reduction; replicated inputs become Partial
   locally, again for free);
3. else ``Replicate``.

The cat dim itself is never sharded (pieces of it would interleave). ``stack`` inserts a new dim,
so shards of dims at or after it move up by one.
"""
from typing import Any
from hyper_parallel.core.dtensor.layout import numel, shard_orders
from hyper_parallel.core.dtensor.ops.registry import OpStrategy, register_rule
from hyper_parallel.core.dtensor.placement_types import Replicate


def common_placements(specs: Any, cat_dim: Any, mesh: Any) -> Any:
    """The layout every input takes (``cat_dim``: the dim that must stay whole, or None)."""
    chosen = []
    for m in range(mesh.ndim):
        votes: dict[Any, Any] = {}
        for s in specs:
            p = s.placements[m]
            if p.is_shard() and p.dim != cat_dim:
                votes[p] = votes.get(p, 0) + numel(s.shape)
        if votes:
            chosen.append(max(votes, key=lambda p: votes[p]))
            continue
        partial_ops = {s.placements[m] for s in specs if s.placements[m].is_partial()}
        chosen.append(partial_ops.pop() if len(partial_ops) == 1 else Replicate())
    ndim = specs[0].ndim
    try:
        shard_orders(chosen, mesh.mesh_shape, ndim)
    except ValueError:  # a StridedShard that lost its partner mesh dim
        chosen = [Replicate() if p.is_shard() and getattr(p, "split_factor", None) else p for p in chosen]
    return tuple(chosen)


def _tensors_arg(call):
    seq = call.args[0] if call.args else call.kwargs.get("tensors")
    if not isinstance(seq, (list, tuple)) or not seq:
        return None
    return seq


@register_rule("cat", "stack")
def cat_rule(call: Any) -> Any:
    seq = _tensors_arg(call)
    if seq is None:
        return None
    specs = [call.spec(t) for t in seq]
    if any(s is None for s in specs) or len(call.specs) != len(seq):
        return None
    ndim = specs[0].ndim
    if ndim == 0 and call.name == "cat" or any(s.ndim != ndim for s in specs):
        return None  # legacy 1-D empty tensors, 0-dim inputs: leave them to the fallback
    dim = call.arg(1, "dim", call.kwargs.get("axis", 0))
    if call.name == "cat":
        dim %= ndim
        common = common_placements(specs, dim, call.mesh)
        out = common
    else:
        dim %= ndim + 1
        common = common_placements(specs, None, call.mesh)
        out = tuple(p.with_dim(p.dim + 1) if p.is_shard() and p.dim >= dim else p for p in common)
    inputs = [None] * len(call.specs)
    for t in seq:
        inputs[call.index(t)] = common
    return OpStrategy(inputs=inputs, outputs=out)


__all__ = ["common_placements", "cat_rule"]
