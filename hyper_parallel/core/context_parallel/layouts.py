"""Where q, k, v and the output live in each context-parallel mode, as DTensor placements.

The sequence arrives split over the CP mesh dims (contiguous blocks). A mode moves some of those
splits from the sequence to the heads (Ulysses, one all-to-all each) and gathers the rest for K/V
(all-gather KV). Placements are derived from shard orders, so they compose with any other split
already on the tensor (TP heads, a StridedShard where CP splits heads inside TP's split).
"""
from typing import Any
from hyper_parallel.core.bounded_cache import BoundedCache
from hyper_parallel.core.dtensor.layout import placements_from_orders, shard_orders
from hyper_parallel.core.dtensor.placement_types import Replicate, Shard


def _orders(placements, mesh, ndim):
    return [list(o) for o in shard_orders(placements, mesh.mesh_shape, ndim)]


def _non_shard(placements):
    return [Replicate() if p.is_shard() else p for p in placements]


_INPUT = BoundedCache(4096)


def input_placements(mesh: Any, ndim: Any, seq_dim: Any, cp_dims: Any, other: Any = None) -> Any:
    """Contiguous sequence blocks over ``cp_dims`` (outer first), plus ``other`` placements.
    Cached per arguments (every ContextParallel call asks, with the same few each step)."""
    key = (id(mesh), ndim, seq_dim, tuple(cp_dims), None if other is None else tuple(other))
    hit = _INPUT.get(key)
    if hit is not None and hit[0] is mesh:
        return hit[1]
    found = _input_placements(mesh, ndim, seq_dim, cp_dims, other)
    _INPUT[key] = (mesh, found)   # holds the mesh: its id cannot be reused while the entry lives
    return found


def _input_placements(mesh, ndim, seq_dim, cp_dims, other):
    placements = list(other) if other is not None else [Replicate()] * mesh.ndim
    orders = _orders(placements, mesh, ndim)
    orders[seq_dim] = list(cp_dims) + orders[seq_dim]
    return placements_from_orders(orders, _non_shard(placements), mesh.mesh_shape)


def mode_placements(placements: Any, mesh: Any, ndim: Any, seq_dim: Any, head_dim: Any, ulysses_dims: Any,
                    gather_dims: Any) -> Any:
    """(q placements, k/v placements) for attention: ``ulysses_dims`` move from the sequence to the
    heads (innermost), then K/V are replicated over ``gather_dims``."""
    orders = _orders(placements, mesh, ndim)
    for m in reversed(ulysses_dims):
        if not orders[seq_dim] or orders[seq_dim][-1] != m:
            raise ValueError(f"mesh dim {m} does not hold the innermost sequence split of {placements}")
        orders[seq_dim].pop()
    for m in ulysses_dims:
        orders[head_dim].append(m)
    non_shard = _non_shard(placements)
    q = placements_from_orders(orders, non_shard, mesh.mesh_shape)
    for m in reversed(gather_dims):
        if orders[seq_dim] and orders[seq_dim][-1] == m:
            orders[seq_dim].pop()
    kv = placements_from_orders(orders, non_shard, mesh.mesh_shape)
    return q, kv


def seq_split(placements: Any, seq_dim: Any) -> Any:
    return [m for m, p in enumerate(placements) if p.is_shard(seq_dim)]


__all__ = ["input_placements", "mode_placements", "seq_split", "Shard"]
