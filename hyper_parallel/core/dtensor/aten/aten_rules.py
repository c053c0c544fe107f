"""Aten-level calls that a sharding rule can run: in-place forms (``addmm_``, ``scatter_``,
``cumsum_``, ``index_add_``, ``masked_fill_``, ``index_put_`` i.e. ``x[idx] = v``), ``out=`` forms
(``torch.where(c, a, b, out=d)``) and ops that only reach DTensors at this level (``x[idx]``:
``index``).

In-place methods stay at the aten level so that autograd records them on the DTensor itself
(platform op_names); without this module each took the replicated fallback. Each call here runs
through the rule of its out-of-place op, on the shards:

1. torch's own checks of the call (shapes, the dtype cast of an in-place result) run on meta tensors,
   before anything moves; an ``out=`` DTensor of another shape raises (a DTensor is not resized);
2. the rule picks the inputs' layouts; the op runs out of place on the moved shards (an in-place op
   on a copy of self: rules' local functions call the op as a function);
3. the result, in the rule's output layout, is laid out in the written tensor's own placements (a
   redistribute, exact) and copied into its shard. The tensor keeps its placements and its storage,
   so views of it see the write, and dispatch carries it into a base (writeback.py).
When the rule keeps self in its own layout and needs no local function, the op runs in place on
self's shard directly. Autograd is above this level: these moves are plain, not differentiable.
"""
from typing import Any
import functools

from hyper_parallel.core.dtensor.dispatch.dispatcher import ensure_leaf_grad_layout
from hyper_parallel.core.dtensor.dtensor import DTensor, as_layout
from hyper_parallel.core.dtensor.ops import get_rule
from hyper_parallel.core.dtensor.ops.advanced_index import prepare_indices
from hyper_parallel.core.dtensor.ops.elementwise import to_input
from hyper_parallel.core.dtensor.ops.registry import OpCall, aten_route
from hyper_parallel.core.dtensor.placement_types import Replicate
from hyper_parallel.core.dtensor.spec import DTensorSpec
from hyper_parallel.core.dtensor.dispatch.tree import tree_flatten, tree_unflatten
from hyper_parallel.platform import get_platform

_SELF, _OUT, _FUNCTION = "self", "out", "function"

# aten op name -> the rule of its out-of-place op. In-place names write self; the others are
# functions here, or write ``out=`` when it is given.
_RULE_OF = {
    "addmm": "addmm", "baddbmm": "baddbmm", "addmv": "addmv",
    "scatter": "scatter", "scatter_add": "scatter", "scatter_reduce": "scatter",
    "index_fill": "index_fill", "index_copy": "index_copy", "index_add": "index_add",
    "cumsum": "cumsum", "masked_fill": "elementwise", "where": "elementwise",
    "index": "index", "index_put": "index_put", "_index_put_impl": "index_put",
    "index_select": "index_select", "gather": "gather",
    # what the backward of an in-place op runs on DTensors (autograd records it at this level)
    "mm": "matmul", "bmm": "matmul", "mv": "matmul", "t": "t", "transpose": "transpose",
    "permute": "permute", "view": "view", "_unsafe_view": "view", "squeeze": "view", "expand": "expand",
    "sum": "sum", "flip": "flip",
    # backward of chunk / split / unbind / stack (gradients concatenated or split), and the aten
    # forms of ops with a user-level rule (softmin, _safe_softmax, inner, F.pad's constant mode)
    "cat": "cat", "stack": "stack", "split": "split", "split_with_sizes": "split",
    "unsafe_split": "split", "unsafe_split_with_sizes": "split", "unsafe_chunk": "chunk",
    "chunk": "chunk", "unbind": "unbind",
    "_softmax": "softmax", "_log_softmax": "softmax", "_safe_softmax": "softmax",
    "dot": "matmul", "vdot": "matmul", "constant_pad_nd": "pad", "unbind_copy": "unbind",
    "_softmax_backward_data": "softmax_backward",
    # of another size than the input (the gradient of x[idx] starts as grad.new_zeros(x.shape))
    "new_zeros": "new_factory", "new_ones": "new_factory", "new_full": "new_factory",
    "new_empty": "new_factory",
}

# the ops above whose in-place form (``addmm_``...) writes self with the op's result
_IN_PLACE = {"addmm", "baddbmm", "addmv", "scatter", "scatter_add", "scatter_reduce", "index_fill",
             "index_copy", "index_add", "cumsum", "masked_fill", "index_put", "_index_put_impl"}


def _names(func):
    packet = getattr(func, "overloadpacket", func)
    return getattr(packet, "__name__", None) or str(func)


def route(func: Any, kwargs: Any) -> Any:
    """(rule name, what the call writes) for an aten call this module runs, or None."""
    name = _names(func)
    written = [pos for pos, _ in get_platform().written_arguments(func)]
    base = name[:-1] if name.endswith("_") else name
    rule, in_place = _RULE_OF.get(base), base in _IN_PLACE
    if rule is None and aten_route(base) is not None:   # routes the rule modules register (ops/)
        rule, in_place = aten_route(base)
    if rule is None and "out" in kwargs and get_platform().aten_kind(func) == "pointwise":
        rule = "elementwise"   # torch.add(a, b, out=c) and the like
    if rule is None or get_rule(rule) is None:
        return None
    if name.endswith("_"):
        return (rule, _SELF) if written == [0] and in_place else None
    if written:
        return (rule, _OUT) if "out" in kwargs and len(written) == 1 else None
    return rule, _FUNCTION


@functools.lru_cache(maxsize=None)
def _functional(func, mode):
    """The op as a function returning a new tensor (what rules and their local functions call)."""
    if mode == _SELF:
        def run(self, *args, **kwargs):
            return func(self.clone(), *args, **kwargs)
    elif mode == _OUT:
        def run(*args, **kwargs):  # type: ignore[misc]  # one name, three signatures
            scratch = kwargs.pop("_hp_out_like")
            return func(*args, **kwargs, out=scratch.new_empty((0,)))
    else:
        def run(*args, **kwargs):  # type: ignore[misc]
            return func(*args, **kwargs)
    base = _names(func)
    run.__name__ = base[:-1] if base.endswith("_") else base   # the name linearity tests read
    return run


def run_by_rule(func: Any, args: Any, kwargs: Any) -> Any:
    """The call's result computed through its rule, or NotImplemented (no route, no strategy)."""
    found = route(func, kwargs)
    if found is None:
        return NotImplemented
    rule_name, mode = found
    kwargs = dict(kwargs)
    target = kwargs.pop("out", None) if mode == _OUT else (args[0] if mode == _SELF else None)
    if mode in (_OUT, _SELF) and not isinstance(target, DTensor):
        return NotImplemented   # a plain tensor written with DTensor operands: the fallback's case
    leaves, structure = tree_flatten((args, kwargs))
    dtensors = [x for x in leaves if isinstance(x, DTensor)]
    if not dtensors:
        return NotImplemented
    mesh = dtensors[0]._spec.mesh
    if any(d._spec.mesh != mesh for d in dtensors):
        return NotImplemented   # the fallback raises the mesh error
    if get_platform().is_grad_enabled():
        for d in dtensors:   # a leaf's gradient keeps the leaf's placements, via this path too
            ensure_leaf_grad_layout(d)
    args, kwargs = prepare_indices(rule_name, mesh, args, kwargs)
    leaves, structure = tree_flatten((args, kwargs))
    leaves = [_promote(x, mesh) for x in leaves]
    return _run(func, mode, rule_name, mesh, target, leaves, structure)


def _run(func, mode, rule_name, mesh, target, leaves, structure):
    functional = _functional(func, mode)
    call_args, call_kwargs = tree_unflatten(leaves, structure)
    if mode == _OUT:
        call_kwargs["_hp_out_like"] = target._local_tensor
    call = OpCall(rule_name, functional, call_args, call_kwargs, mesh,
                  [x for x in leaves if isinstance(x, DTensor)],
                  meta_fn=lambda: _meta_shapes(functional, call_args, call_kwargs))
    shapes = call.out_shapes   # torch's own checks of the call (an in-place result it cannot cast...)
    if len(shapes) != 1 and mode != _FUNCTION:
        return NotImplemented
    if mode == _OUT and tuple(shapes[0]) != tuple(target.shape):
        raise ValueError(f"{_names(func)}(..., out=) into a DTensor of shape {tuple(target.shape)}: the "
                         f"result has shape {tuple(shapes[0])} and hyper_parallel does not resize a "
                         f"DTensor; pass out= of the result's shape, or use the op's return value")
    strategy = get_rule(rule_name)(call)
    if strategy is None:
        return NotImplemented
    out = strategy.outputs[0] if isinstance(strategy.outputs, list) else strategy.outputs
    targets = [strategy.inputs[call.index(x)] or x._spec.placements if isinstance(x, DTensor) else None
               for x in leaves]
    locals_ = [_move(x, t) if t is not None else x for x, t in zip(leaves, targets)]
    in_place = mode == _SELF and strategy.local is None and out == target._spec.placements \
        and targets[0] == target._spec.placements
    if in_place:   # self stays where it is: the op writes its own shard
        locals_[0] = target._local_tensor
        local_args, local_kwargs = tree_unflatten(locals_, structure)
        func(*local_args, **local_kwargs)
        return target
    local_args, local_kwargs = tree_unflatten(locals_, structure)
    if mode == _OUT:
        local_kwargs["_hp_out_like"] = target._local_tensor
    result = strategy.local(call, local_args, local_kwargs) if strategy.local is not None \
        else functional(*local_args, **local_kwargs)
    if isinstance(result, (tuple, list)):   # split / unbind: one DTensor per piece
        return _wrap_pieces(result, strategy.outputs, mesh, call.out_shapes)
    value = DTensor._make(result, DTensorSpec(mesh, tuple(out), tuple(call.out_shapes[0])))
    if target is None:
        return value
    target._local_tensor.copy_(as_layout(value, target._spec)._local_tensor)
    return target


def _wrap_pieces(result, outputs, mesh, shapes):
    """The pieces of a multi-output op, each in its placements (one list per output, or the same
    placements for every output)."""
    per = outputs if isinstance(outputs, list) else [outputs] * len(result)
    shapes = iter(shapes)   # one per tensor: an output a mask turned off (None) has none
    return type(result)(r if r is None else DTensor._make(r, DTensorSpec(mesh, tuple(p), tuple(next(shapes))))
                        for r, p in zip(result, per))


def _meta_shapes(functional, args, kwargs):
    platform = get_platform()

    def to_meta(x):
        if isinstance(x, DTensor):
            return platform.meta_tensor(x._spec.shape, x.dtype)
        return platform.to_meta(x) if platform.is_tensor(x) else x
    leaves, structure = tree_flatten((args, kwargs))
    meta_args, meta_kwargs = tree_unflatten([to_meta(x) for x in leaves], structure)
    with platform.no_grad():
        outs, _ = tree_flatten(functional(*meta_args, **meta_kwargs))
    return [tuple(o.shape) for o in outs if platform.is_tensor(o)]


def _promote(x, mesh):
    """A plain tensor beside DTensors is taken as replicated (0-dim ones stay scalars)."""
    if get_platform().is_tensor(x) and not isinstance(x, DTensor) and x.ndim > 0:
        return DTensor._make(x, DTensorSpec(mesh, (Replicate(),) * mesh.ndim, tuple(x.shape)))
    return x


def copy_source(src: Any, spec: Any) -> Any:
    """The local piece ``copy_`` into a DTensor of ``spec`` reads: ``src`` laid out as the target is,
    along the dims it has, and replicated along those it broadcasts over (a plain ``src`` is a
    replicated global value of its own shape)."""
    if not get_platform().is_tensor(src):
        return src
    if not isinstance(src, DTensor):   # 0-dim too: into a Partial target it is laid out as Partial
        src = DTensor._make(src, DTensorSpec(spec.mesh, (Replicate(),) * spec.mesh.ndim, tuple(src.shape)))
    placements = tuple(to_input(p, src._spec.shape, spec.shape) for p in spec.placements)
    return _move(src, placements)


def _move(x, placements):
    if tuple(placements) == tuple(x._spec.placements):
        return x._local_tensor
    return as_layout(x, x._spec.with_placements(tuple(placements)))._local_tensor


__all__ = ["copy_source", "route", "run_by_rule"]
