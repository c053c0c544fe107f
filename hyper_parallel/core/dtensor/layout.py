"""Which slice of the global tensor a rank holds.

Shards of one tensor dim are applied one mesh dim after another, each a ``torch.chunk`` of what the
previous ones left, so a local shard is always a contiguous range per dim. Plain ``Shard``s apply
in mesh-dim order; a ``StridedShard(d, k)`` applies after the later mesh dims of total size k.
"""
from typing import Any
import math

from hyper_parallel.core.dtensor.placement_types import Replicate, Shard, StridedShard


def numel(shape: Any) -> Any:
    """Number of elements of a tensor of ``shape`` (1 for a 0-dim tensor)."""
    return math.prod(shape)


def chunk_sizes(length: Any, parts: Any) -> Any:
    """Sizes of ``torch.chunk(length, parts)`` padded with empty trailing chunks to ``parts``."""
    step = -(-length // parts) if length else 0
    return [max(0, min(step, length - i * step)) for i in range(parts)]


def chunk_range(start: Any, length: Any, parts: Any, index: Any) -> Any:
    """(start, length) of piece ``index`` when [start, start+length) is chunked into ``parts``."""
    step = -(-length // parts) if length else 0
    lo = min(index * step, length)
    return start + lo, max(0, min(step, length - lo))


def shard_orders(placements: Any, mesh_shape: Any, ndim: Any) -> Any:
    """For each tensor dim, the mesh dims that split it, in the order the splits apply."""
    orders: Any = [[] for _ in range(ndim)]
    for m in reversed(range(len(placements))):
        p = placements[m]
        if not p.is_shard():
            continue
        order = orders[p.dim]
        if isinstance(p, StridedShard):
            prefix, acc = 0, 1
            while acc < p.split_factor and prefix < len(order):
                acc *= mesh_shape[order[prefix]]
                prefix += 1
            if acc != p.split_factor:
                raise ValueError(f"{p!r} on mesh dim {m}: no later mesh dims splitting dim {p.dim} "
                                 f"multiply to split_factor {p.split_factor}")
            order.insert(prefix, m)
        else:
            order.insert(0, m)
    return orders


def placements_from_orders(orders: Any, non_shard: Any, mesh_shape: Any) -> Any:
    """Inverse of ``shard_orders``: ``non_shard`` gives R/P placements for mesh dims not splitting."""
    placements = list(non_shard)
    for dim, order in enumerate(orders):
        for pos, m in enumerate(order):
            later_first = [o for o in order[:pos] if o > m]
            factor = math.prod(mesh_shape[o] for o in later_first)
            placements[m] = StridedShard(dim, factor) if later_first else Shard(dim)
    return tuple(placements)


def dim_range(length: Any, order: Any, placements: Any, mesh_shape: Any, coordinate: Any,
              upto: Any = None) -> Any:
    """(start, size) of the global range along one tensor dim after the first ``upto`` splits."""
    start, size = 0, length
    for m in order[:upto]:
        index, parts = placements[m].chunk_of(coordinate[m], mesh_shape[m])
        start, size = chunk_range(start, size, parts, index)
    return start, size


def local_box(shape: Any, placements: Any, mesh_shape: Any, coordinate: Any) -> Any:
    """[(start, size)] per tensor dim of the slice held at ``coordinate``."""
    orders = shard_orders(placements, mesh_shape, len(shape))
    return [dim_range(shape[d], orders[d], placements, mesh_shape, coordinate) for d in range(len(shape))]


def local_shape(shape: Any, placements: Any, mesh_shape: Any, coordinate: Any) -> Any:
    return tuple(size for _, size in local_box(shape, placements, mesh_shape, coordinate))


def grad_placements(placements: Any) -> Any:
    """Gradient layout of a forward value: a Partial value's gradient is replicated."""
    return tuple(Replicate() if p.is_partial() else p for p in placements)
