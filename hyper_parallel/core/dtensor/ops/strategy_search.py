"""Pick the cheapest of several candidate layouts for an op, one mesh dim at a time.

A candidate says which placement each input needs and what the output then is. Its cost is the
bytes the inputs must move to get there; ties go to the candidate that changes the fewest inputs,
then to the earlier one (rules list the preferred layouts first).
"""
from typing import Any


def move_cost(src: Any, dst: Any, numel: Any, n: Any) -> Any:
    """Elements one rank sends to move a tensor of ``numel`` elements from ``src`` to ``dst``."""
    if src == dst or (src.is_replicate() and not dst.is_replicate() and not src.is_partial()):
        return 0
    if src.is_shard() and dst.is_shard():
        return numel / n
    if src.is_shard():                     # -> Replicate / Partial: all-gather
        return numel * (n - 1) / n
    if src.is_partial():
        return numel if dst.is_shard() else 2 * numel
    return 0


def pick(candidates: Any, current: Any, numels: Any, n: Any) -> Any:
    """``candidates``: [(input placements list, output placement)] for one mesh dim."""
    best, best_key = None, None
    for order, (inputs, out) in enumerate(candidates):
        cost = sum(move_cost(c, t, k, n) for c, t, k in zip(current, inputs, numels) if t is not None)
        changed = sum(1 for c, t in zip(current, inputs) if t is not None and c != t)
        key = (cost, changed, order)
        if best_key is None or key < best_key:
            best, best_key = (inputs, out), key
    return best
