"""Flatten nested args (tuples, lists, dicts) to leaves and back. The structure is made of tuples,
so it is hashable (the decision cache keys calls by it) whenever the dict keys are.

Most op calls are ``(args, {})`` with no nesting: their structure is shared per arity, and both
directions take a short path (dispatch flattens and rebuilds every call's arguments)."""
from typing import Any
_FLAT: dict[Any, Any] = {}


def _flat_structure(n):
    found = _FLAT.get(n)
    if found is None:
        found = _FLAT[n] = (tuple, ((tuple, (None,) * n), (dict, ())))
    return found


def tree_flatten(obj: Any) -> Any:
    if (type(obj) is tuple and len(obj) == 2 and type(obj[0]) is tuple and obj[1] == {}
            and not any(isinstance(a, (list, tuple, dict)) for a in obj[0])):
        return list(obj[0]), _flat_structure(len(obj[0]))
    if not isinstance(obj, (list, tuple, dict)):
        return [obj], None
    leaves: list[Any] = []
    return leaves, _walk(obj, leaves)


def _walk(node, leaves):
    # module-level, not a closure: a nested function that calls itself is a reference cycle
    # through its own cell, which kept the leaves (tensors) alive until the cyclic collector ran
    if isinstance(node, (list, tuple)):
        return (type(node), tuple(_walk(x, leaves) for x in node))
    if isinstance(node, dict):
        return (dict, tuple((k, _walk(v, leaves)) for k, v in node.items()))
    leaves.append(node)
    return None


def tree_unflatten(leaves: Any, structure: Any) -> Any:
    if structure is None:
        return leaves[0]
    if structure is _FLAT.get(len(leaves)):
        return tuple(leaves), {}
    return _build(structure, iter(leaves))


def _build(node, it):
    if node is None:
        return next(it)
    kind, children = node
    if kind is dict:
        return {k: _build(v, it) for k, v in children}
    items = [_build(c, it) for c in children]
    if kind in (list, tuple):
        return kind(items)
    return kind(*items) if hasattr(kind, "_fields") else kind(items)
