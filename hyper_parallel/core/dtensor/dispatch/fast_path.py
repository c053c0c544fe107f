"""The cache-hit fast path of DTensor dispatch: local op -> wrap, nothing else.

Most calls in a loop repeat a call seen before with inputs already in the layout the rule wants:
``(x + x) @ w``, ``relu``, ``* 2.0`` on a ``Shard(0)`` activation. For those the full dispatcher
(``dispatch.py``: flatten, interceptors, rule or decision cache, redistribution, wrap) re-derives
what the first call already settled. This module keeps, per call signature, what such a call
needs and nothing more: the output's spec and, for autograd, the gradient specs of the inputs.

The signature is keyed cheaply: ``(name, func, token, token, ...)``, two tokens per argument: a
DTensor gives the *identity* of its spec and its dtype, a plain value its type and itself, a
keyword its name (a str) and then (type, value). An id is an int and the other first tokens are
types or strs, so tokens of different kinds never compare equal. The op name is keyed although
torch's callables each have one: MindSpore's op objects may come under more than one. Identity
is safe because the entry keeps those spec objects alive (no other object can take their ids),
and it hits because specs are interned: equal specs on the same mesh object become one object (a
spec is an immutable value, so swapping a DTensor's spec for an equal one changes nothing), and
every output of a fast call carries the entry's spec.

Calls of one or two positional arguments, the first a DTensor (``x + y``, ``x * 2.0``,
``relu(x)``, ``x @ w``), build that key without a loop; the rest go through ``_general``.

Only the simplest calls take this path; anything else goes to ``dispatch_function``, which
records an entry when the call qualifies (``_record``): a cacheable rule, no interceptor, no
in-place request, no view op, no plain tensor argument, no nesting, inputs already placed, no
rule-supplied local function, one tensor output. Without autograd the call is the local op and
one wrap. With autograd it builds the slow path's nodes with the same gradient specs and
pass-through dims (``_run_differentiable``), so gradients are the slow path's exactly.
"""
from typing import Any
from hyper_parallel.core.bounded_cache import BoundedCache, lifetime_key
from hyper_parallel.core.dtensor.dispatch import decision_cache
from hyper_parallel.core.dtensor.dispatch.dispatcher import (_passthrough, dispatch_function,
                                                             ensure_leaf_grad_layout, input_grad_placements)
from hyper_parallel.core.dtensor.dtensor import DTensor, GradPassThrough
from hyper_parallel.core.dtensor.dispatch.fast_autograd import from_local, to_locals
from hyper_parallel.core.dtensor.dispatch.interceptors import _stack, involved
from hyper_parallel.platform import get_platform

_make = DTensor._make
# the platform's lean wrapper constructor and grad-mode query, if it has them (else the same, slower)
_new = getattr(DTensor, "_hp_fast_new", None)
_grad_enabled = getattr(DTensor, "_hp_grad_enabled", None)
_ENTRIES = BoundedCache(65536)
_SPECS = BoundedCache(65536)
# argument types that are plain values without a look (the rest are checked by _plain_value)
_SCALARS = frozenset({int, float, bool, complex, str, type(None)})
STATS = decision_cache.STATS   # "fast_hits" counts calls served here


class _Entry:
    __slots__ = ("specs", "positions", "out_spec", "shape", "grad_specs", "passthrough_dims")

    def __init__(self, specs, positions, out_spec, grad_specs, passthrough_dims):
        self.specs = specs                # keeps the keyed spec objects alive (see module doc)
        self.positions = positions        # where the DTensor arguments are
        self.out_spec = out_spec
        self.shape = out_spec.shape
        self.grad_specs = grad_specs      # per DTensor argument, as dispatch._run_on_shards gives
        self.passthrough_dims = passthrough_dims


def _plain_value(value):
    """A hashable non-tensor value (a dtype, a tuple of ints...) that can stand in a key."""
    if get_platform().is_tensor(value) or isinstance(value, (list, dict, set)):
        return False
    if isinstance(value, tuple) and not all(type(v) in _SCALARS for v in value):
        return False
    try:
        hash(value)
    except TypeError:  # slices
        return False
    return True


def _platform_grad_enabled():
    return get_platform().is_grad_enabled()


def _platform_requires_grad(tensor):
    return get_platform().requires_grad(tensor)


_tracking = _grad_enabled or _platform_grad_enabled
_requires_grad = getattr(DTensor, "_hp_requires_grad", None) or _platform_requires_grad
_is_leaf = getattr(DTensor, "_hp_is_leaf", None)   # else ensure_leaf_grad_layout asks grad_fn


def dispatch(name: str, func: Any, args: Any, kwargs: Any, hit_only: bool = False) -> Any:
    """Run a user-level op on DTensors: the fast path on a hit, else ``dispatch_function``; with
    ``hit_only``, NotImplemented instead of anything but a plain hit (the platform's operator
    methods then take torch's usual route). Inline rather than in helpers: every frame and every
    pass here is paid on every op."""
    n = len(args)
    if kwargs or n > 2 or n == 0 or type(args[0]) is not DTensor:
        return NotImplemented if hit_only else _general(name, func, args, kwargs)
    a = args[0]
    la = a._local_tensor
    if n == 1:
        key: tuple = (name, func, id(a._spec), la.dtype)
        entry = _ENTRIES.get(key)
        if entry is None or (_stack.get() and involved([a]) is not None):
            return NotImplemented if hit_only else _miss(name, func, args, kwargs, key, entry)
        STATS["fast_hits"] += 1
        if a.requires_grad and _tracking():
            return _run_differentiable(entry, name, func, args, None)
        out = func(la)
    else:
        b = args[1]
        kind = type(b)
        if kind is DTensor:
            lb = b._local_tensor
            key = (name, func, id(a._spec), la.dtype, id(b._spec), lb.dtype)
        elif kind in _SCALARS:
            lb = b
            key = (name, func, id(a._spec), la.dtype, kind, b)
        else:
            return NotImplemented if hit_only else _general(name, func, args, kwargs)
        entry = _ENTRIES.get(key)
        if entry is None or (_stack.get() and involved(list(args)) is not None):
            return NotImplemented if hit_only else _miss(name, func, args, kwargs, key, entry)
        STATS["fast_hits"] += 1
        if (a.requires_grad or (kind is DTensor and b.requires_grad)) and _tracking():
            return _run_differentiable(entry, name, func, args, None)
        out = func(la, lb)
    if _new is None or not out.is_contiguous():  # a strided shard: __new__ gives the global strides
        return _make(out, entry.out_spec)
    obj = _new(DTensor, entry.shape, dtype=out.dtype, device=out.device)
    obj._local_tensor = out
    obj._spec = entry.out_spec
    return obj


def _general(name, func, args, kwargs):
    """Any other call: one loop builds the key, the local arguments and the autograd question."""
    key = [name, func]
    append = key.append
    local_args = []
    push = local_args.append
    tracked = False
    for a in args:
        kind = type(a)
        if kind is DTensor:
            local = a._local_tensor
            append(id(a._spec))
            append(local.dtype)
            push(local)
            tracked = tracked or a.requires_grad
        elif kind in _SCALARS or _plain_value(a):
            append(kind)
            append(a)
            push(a)
        else:
            return dispatch_function(name, func, args, kwargs or {})
    if kwargs and not _key_kwargs(kwargs, append):
        return dispatch_function(name, func, args, kwargs)
    key = tuple(key)
    entry = _ENTRIES.get(key)
    if entry is None or (_stack.get() and involved(list(args)) is not None):
        return _miss(name, func, args, kwargs, key, entry)
    STATS["fast_hits"] += 1
    if tracked and _tracking():
        return _run_differentiable(entry, name, func, args, kwargs)
    out = func(*local_args, **kwargs) if kwargs else func(*local_args)
    return _make(out, entry.out_spec) if _new is None else _wrap(out, entry)


def _key_kwargs(kwargs, append):
    """Append keyword arguments to a key; False if one is not a plain value (e.g. a tensor)."""
    for k, v in kwargs.items():
        kind = type(v)
        if not (kind in _SCALARS or _plain_value(v)):
            return False
        append(k)   # a str: never equal to an id (int) or a type, so tokens cannot alias
        append((kind, v))
    return True


def _wrap(out, entry):
    if not out.is_contiguous():  # a strided shard (a transpose...): __new__ gives the global strides
        return _make(out, entry.out_spec)
    obj = _new(DTensor, entry.shape, dtype=out.dtype, device=out.device)
    obj._local_tensor = out
    obj._spec = entry.out_spec
    return obj


def _miss(name, func, args, kwargs, key, entry):
    """Not a plain hit: an interceptor follows an argument (``entry`` is set), or the arguments'
    specs are not interned yet (a new DTensor: intern and look again), or the call is new (the
    full dispatcher then records it)."""
    kwargs = kwargs or {}
    if entry is not None:
        return dispatch_function(name, func, args, kwargs)
    if _intern_args(args):
        return dispatch(name, func, args, kwargs)
    return dispatch_function(name, func, args, kwargs, record=lambda *a: _record(key, *a))


def _run_differentiable(entry, name, func, args, kwargs):
    """As dispatch._run_on_shards does for a call with placed inputs and one output, with the
    nodes of fast_autograd.py: the DTensor inputs that require grad become shards through one
    node, the others are read directly; an output that requires grad is wrapped through one."""
    dims = entry.passthrough_dims
    passthrough = GradPassThrough(dims) if dims else None
    positions = entry.positions
    tracked = [i for i in positions if args[i].requires_grad]
    if len(tracked) > 2 and _thrice(args, tracked):
        # three gradients of one input are summed in the order the engine runs their nodes:
        # only the slow path's nodes give the slow path's rounding
        return dispatch_function(name, func, args, kwargs or {})
    for i in tracked:
        a = args[i]
        if _is_leaf is None or (_is_leaf(a) and not getattr(a, "_hp_hooked", False)):
            ensure_leaf_grad_layout(a)
    if len(tracked) == len(args):   # every argument a DTensor requiring grad: x + y, relu(x)
        if len(args) == 2 and args[0] is args[1]:
            # x + x, x * x: one shard for both (its two gradients are summed before the wrap,
            # rather than as two DTensors after: the same sum of two)
            local_args = to_locals(entry.grad_specs[:1], passthrough, args[0]) * 2
        else:
            local_args = to_locals(entry.grad_specs, passthrough, *args)
    else:
        local_args = [a._local_tensor if type(a) is DTensor else a for a in args]
        specs = entry.grad_specs if len(tracked) == len(positions) else \
            tuple(spec for i, spec in zip(positions, entry.grad_specs) if i in tracked)
        for i, local in zip(tracked, to_locals(specs, passthrough, *[args[i] for i in tracked])):
            local_args[i] = local
    out = func(*local_args, **kwargs) if kwargs else func(*local_args)
    if _requires_grad(out):
        return from_local(out, entry.out_spec, passthrough)
    return _make(out, entry.out_spec) if _new is None else _wrap(out, entry)


def _thrice(args, tracked):
    ids = [id(args[i]) for i in tracked]
    return any(ids.count(k) > 2 for k in ids)


def _record(key, args, targets, out_placements, result):
    """Called by dispatch_function for a call that qualifies (see module doc)."""
    positions = tuple(i for i, a in enumerate(args) if type(a) is DTensor)
    if not positions:
        return
    mesh = args[positions[0]]._spec.mesh
    out_spec = intern(result._spec)
    result._spec = out_spec
    replicated_out = [all(p[m].is_replicate() for p in out_placements) for m in range(mesh.ndim)]
    grad_specs = tuple(args[i]._spec.with_placements(input_grad_placements(targets[i], replicated_out))
                       for i in positions)
    passthrough = _passthrough(out_placements, [targets[i] for i in positions], replicated_out)
    _ENTRIES[key] = _Entry(tuple(args[i]._spec for i in positions), positions, out_spec, grad_specs,
                           passthrough.dims if passthrough is not None else None)


def intern(spec: Any) -> Any:
    """The one spec object standing for ``spec``'s value on ``spec``'s mesh object."""
    k = (lifetime_key(spec.mesh), spec.placements, spec.shape)
    found = _SPECS.get(k)
    if found is None:
        _SPECS[k] = found = spec
    return found


def _intern_args(args):
    changed = False
    for a in args:
        if type(a) is DTensor:
            spec = intern(a._spec)
            if spec is not a._spec:
                a._spec = spec
                changed = True
    return changed


def clear() -> None:
    _ENTRIES.clear()
    _SPECS.clear()


decision_cache.ON_CLEAR.append(clear)


__all__ = ["STATS", "clear", "dispatch", "intern"]
