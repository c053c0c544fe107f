"""``BoundedCache``: the one kind of cache core keeps for decisions taken per call signature;
``lifetime_key`` and ``IdentityTable`` for what is keyed by an object (never by ``id()``).

Sharding decisions, movement plans, verified shape signatures: a training loop repeats a few
signatures, so these caches stay small; one that reaches its limit is fed keys that do not repeat
(shapes changing every step) and simply starts over. Every cache empties at ``reset_platform()``
(its values may hold objects of the old platform) and with ``clear_all()``.
"""
from typing import Any
import itertools
import weakref

from hyper_parallel.platform import on_reset

_ALL: list[Any] = []   # weak references to every cache


class BoundedCache(dict):
    """A dict of at most ``limit`` entries: adding one more empties it first."""

    def __init__(self, limit: int = 4096) -> None:
        super().__init__()
        self.limit = limit
        _ALL.append(weakref.ref(self))

    def __setitem__(self, key, value):
        if len(self) >= self.limit and key not in self:
            self.clear()
        super().__setitem__(key, value)

    def add(self, key: Any) -> None:
        """Set semantics for caches that only remember keys (``key in cache``)."""
        self[key] = True


def clear_all() -> None:
    _ALL[:] = [ref for ref in _ALL if ref() is not None]
    for ref in _ALL:
        cache = ref()
        if cache is not None:
            cache.clear()


on_reset(clear_all)


_SERIALS = itertools.count()


def lifetime_key(obj: Any) -> Any:
    """A cache key for ``obj`` that no other object of this process ever gets. ``id(obj)`` is not
    one: once ``obj`` dies, a new object may take its address, and a decision cached for the dead
    one (a cross-rank check already passed, an output layout learnt) would apply to the new one —
    on the ranks whose allocator happened to reuse it, leaving the others in a collective alone."""
    key = obj.__dict__.get("_hp_lifetime_key")
    if key is None:
        key = obj.__dict__["_hp_lifetime_key"] = next(_SERIALS)
    return key


_MISSING = object()


class IdentityTable:
    """Values attached to objects by identity, each entry living exactly as long as its object: the
    one helper for tables keyed by tensors, parameters and modules (objects that are neither
    hashable by value nor long-lived; per-signature caches use ``BoundedCache`` with values and
    ``lifetime_key`` instead). An entry is filed under the object's address with a weak reference
    whose callback removes it when the object dies, and a lookup also checks that the reference
    still points at the object asked about, so a newer object at a reused address never finds a
    dead one's value. Callers never see an address. An object without weak references raises
    TypeError on insertion."""
    __slots__ = ("_entries",)

    def __init__(self) -> None:
        self._entries: dict = {}

    def __setitem__(self, obj: Any, value: Any) -> None:
        entries, key = self._entries, id(obj)

        def forget(ref: Any, key: int = key) -> None:
            if entries.get(key, (None,))[0] is ref:
                del entries[key]
        entries[key] = (weakref.ref(obj, forget), value)

    def get(self, obj: Any, default: Any = None) -> Any:
        entry = self._entries.get(id(obj))
        if entry is None or entry[0]() is not obj:
            return default
        return entry[1]

    def __contains__(self, obj: Any) -> bool:
        return self.get(obj, _MISSING) is not _MISSING

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()
