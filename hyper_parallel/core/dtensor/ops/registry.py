"""The registry of sharding rules, keyed by framework-neutral op name.

A rule takes an :class:`OpCall` and returns an :class:`OpStrategy` (or None: no strategy for these
inputs, use the replicate fallback). Rules never communicate themselves; they say which layout
each input must have and what layout the outputs then have, and may supply a ``local`` callable
that runs the op on the shards (to pass local shapes, offsets or masks).
"""
from typing import Any, Optional
from dataclasses import dataclass

_RULES: dict[Any, Any] = {}
_OVERRIDES: dict[Any, Any] = {}   # name -> rule registered by the user (register_sharding), consulted first


_UNCACHEABLE: set[Any] = set()


def register_rule(*names: Any, cacheable: bool = True) -> Any:
    """Register ``fn`` for op ``names``. ``cacheable=False`` for a rule whose decision reads state
    outside the call (see decision_cache.py)."""
    def decorator(fn):
        for name in names:
            if name in _RULES:
                raise ValueError(f"a sharding rule for {name!r} is already registered")
            _RULES[name] = fn
            if not cacheable:
                _UNCACHEABLE.add(name)
        return fn
    return decorator


# aten op name -> (rule name, whether its in-place form ``name_`` writes self)
_ATEN_ROUTES: dict[Any, Any] = {}


def register_aten(rule_name: str, *aten_names: Any, in_place: bool = False) -> None:
    """Run the aten ops ``aten_names`` (packet names, without a trailing ``_``) through the rule
    ``rule_name`` when they reach DTensors below autograd (ops with no user-level spelling the
    platform maps, and the backward ops autograd runs on DTensors). ``in_place``: the op's
    ``name_`` form writes self with the op's result, so it may run through the rule too."""
    for name in aten_names:
        if name in _ATEN_ROUTES:
            raise ValueError(f"aten op {name!r} is already routed to {_ATEN_ROUTES[name][0]!r}")
        _ATEN_ROUTES[name] = (rule_name, in_place)


def aten_route(aten_name: str) -> Any:
    """(rule name, in-place form allowed) registered for an aten op, or None."""
    return _ATEN_ROUTES.get(aten_name)


def is_cacheable(name: str) -> bool:
    return name not in _UNCACHEABLE


def get_rule(name: str) -> Any:
    if _OVERRIDES:
        found = _OVERRIDES.get(name)
        if found is not None:
            return found
    return _RULES.get(name)


def registered_ops() -> Any:
    return sorted(_RULES)


@dataclass
class OpStrategy:
    inputs: list                 # placements per DTensor input (OpCall.specs order)
    outputs: object              # placements for every output, or a list with one per output
    local: object = None         # local(call, args, kwargs) -> result, on local shards


class OpCall:
    """One call of an op on DTensors, as a rule sees it."""

    def __init__(self, name: str, func: Any, args: Any, kwargs: Any, mesh: Any, dtensors: Any,
                 meta_fn: Any = None) -> None:
        self.name, self.func, self.args, self.kwargs = name, func, args, kwargs
        self._meta_fn = meta_fn
        self._out_shapes: Optional[list[Any]] = None
        self.mesh = mesh
        self.dtensors = dtensors            # DTensor leaves, in flatten order
        self.specs = [d._spec for d in dtensors]
        self._index: dict[Any, Any] = {}
        for i, d in enumerate(dtensors):
            self._index.setdefault(id(d), i)  # an input passed twice answers to its first position

    @property
    def out_shapes(self) -> Any:
        """Global shapes of the tensor outputs (from running the op on meta tensors)."""
        if self._out_shapes is None:
            self._out_shapes = self._meta_fn()
        return self._out_shapes

    def set_out_shapes(self, shapes: Any) -> None:
        """For rules that know the output shapes without a meta run (which cannot follow every
        argument, e.g. ``.to("cpu")``)."""
        self._out_shapes = list(shapes)

    def arg(self, position: Any, name: str, default: Any = None) -> Any:
        if len(self.args) > position:
            return self.args[position]
        return self.kwargs.get(name, default)

    def index(self, obj: Any) -> Any:
        """Position of ``obj`` among the DTensor inputs, or None if it is not one."""
        return self._index.get(id(obj))

    def spec(self, obj: Any) -> Any:
        i = self.index(obj)
        return None if i is None else self.specs[i]

    @property
    def mesh_ndim(self) -> Any:
        return self.mesh.ndim
