"""The sharding-decision cache: one rule evaluation per call signature.

A training loop repeats the same op calls step after step. A call's signature is the op, the
structure of its arguments, every DTensor's mesh, placements, global shape and dtype, every plain
tensor's shape and dtype, and every other argument's value; for a given signature a rule always
returns the same strategy and the op the same output shapes. So both are kept, and a repeated call
goes straight to redistribution, the local op and wrapping: no rule, no meta-tensor run.

Rules whose decision reads state outside the call (``loss_parallel()`` is on or off) register
with ``cacheable=False``; calls an interceptor takes over are never cached.
"""
from typing import Any
from hyper_parallel.core.bounded_cache import BoundedCache

_DECISIONS = BoundedCache(65536)
STATS = {"rule_evaluations": 0, "hits": 0, "fast_hits": 0}


def signature(name: str, func: Any, mesh: Any, leaves: Any, structure: Any, is_tensor: Any,
              dtensor_type: Any) -> Any:
    """The call's signature (hashable)."""
    key = [name, func, mesh, structure]
    for leaf in leaves:
        if isinstance(leaf, dtensor_type):
            spec = leaf._spec
            key.append(("D", spec.placements, spec.shape, leaf.dtype))
        elif is_tensor(leaf):
            key.append(("T", tuple(leaf.shape), leaf.dtype))
        else:
            try:
                hash(leaf)
                key.append((type(leaf), leaf))  # 1, 1.0 and True are equal keys; typed, they differ
            except TypeError:  # slices in an index
                key.append((type(leaf), repr(leaf)))
    return tuple(key)


def lookup(key: Any) -> Any:
    found = _DECISIONS.get(key)
    if found is not None:
        STATS["hits"] += 1
    return found


def store(key: Any, strategy: Any, out_shapes: Any) -> None:
    _DECISIONS[key] = (strategy, out_shapes)


ON_CLEAR: list[Any] = []   # other caches built on these decisions (fast_path.py) register their clear here


def clear() -> None:
    _DECISIONS.clear()
    for hook in ON_CLEAR:
        hook()
    STATS.update(rule_evaluations=0, hits=0, fast_hits=0)


__all__ = ["ON_CLEAR", "STATS", "clear", "lookup", "signature", "store"]
