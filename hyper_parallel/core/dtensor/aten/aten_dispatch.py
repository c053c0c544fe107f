"""The aten ops that reach a DTensor below autograd (see the platform's DTensorBase).

These are autograd-engine internals (gradient accumulation, ``ones_like`` for ``backward()``),
optimizer updates, in-place methods and ops with no user-level rule. Autograd is above this level,
so the redistributions here are plain (non-differentiable) moves.
"""
from typing import Any
from hyper_parallel.core.dtensor.aten import writeback
from hyper_parallel.core.dtensor.aten.aten_rules import copy_source, run_by_rule
from hyper_parallel.core.dtensor.dtensor import DTensor, as_layout
from hyper_parallel.core.dtensor.dispatch.dispatcher import common_mesh, ensure_leaf_grad_layout
from hyper_parallel.core.dtensor.dispatch.fallback import report_missing_rule
from hyper_parallel.core.dtensor.aten.inplace_shape import reshape_in_place
from hyper_parallel.core.dtensor.dispatch.interceptors import screen
from hyper_parallel.core.dtensor.layout import grad_placements
from hyper_parallel.core.dtensor.ops.elementwise import elementwise_strategy, linearity_name
from hyper_parallel.core.dtensor.ops.user_sharding import run_user_op, user_op_function
from hyper_parallel.core.dtensor.placement_types import Replicate
from hyper_parallel.core.dtensor.spec import DTensorSpec
from hyper_parallel.core.dtensor.dispatch.tree import tree_flatten, tree_unflatten
from hyper_parallel.platform import get_platform
from hyper_parallel.core.dtensor.aten.foreach import run_foreach


def _op_name(func):
    return getattr(getattr(func, "overloadpacket", func), "__name__", str(func))


def _is_inplace(func):
    return any(position == 0 for position, _ in get_platform().written_arguments(func))


def _written(func, args, kwargs):
    """(position, keyword) of every argument the op writes into: self for in-place ops, and the
    others too (batch_norm's running stats, rrelu's noise, ``out=``)."""
    written = get_platform().written_arguments(func)
    return [(i, None) if i < len(args) else (None, name) for i, name in written]


def _mutates_others(func, args, kwargs):
    return any(pos != 0 for pos, _ in _written(func, args, kwargs))


def _write_full_values(func, args, kwargs, local_args, local_kwargs):
    """After the op ran on replicated copies: lay each written copy out into its DTensor."""
    for pos, key in _written(func, args, kwargs):
        target = args[pos] if key is None else kwargs.get(key)
        if not isinstance(target, DTensor):
            continue
        full = local_args[pos] if key is None else local_kwargs[key]
        replicated = target._spec.with_placements((Replicate(),) * target._spec.mesh.ndim)
        target._local_tensor.copy_(_move(DTensor._make(full, replicated), target._spec))


def _as_spec(x, mesh):
    if isinstance(x, DTensor):
        return x._spec
    if get_platform().is_tensor(x) and x.ndim > 0:
        return DTensorSpec(mesh, (Replicate(),) * mesh.ndim, tuple(x.shape))
    return None


def _move(x, spec):
    """The local shard of ``x`` (DTensor or replicated plain tensor) in layout ``spec``."""
    return as_layout(x, spec)._local_tensor


def _wrap_outputs(result, mesh, placements_for, shape_for, relayout=None):
    leaves, structure = tree_flatten(result)
    out = []
    for i, leaf in enumerate(leaves):
        if get_platform().is_tensor(leaf) and not isinstance(leaf, DTensor):
            leaf = DTensor._make(leaf, DTensorSpec(mesh, placements_for(i), shape_for(i, leaf)))
            if relayout is not None:
                leaf = relayout(leaf)
        out.append(leaf)
    return tree_unflatten(out, structure)


def _alias(func, args, kwargs):
    """detach / alias / clone / _to_copy keep the layout; a Partial value cast to an integer or bool
    dtype is reduced first (truncating each piece is not truncating the sum)."""
    src = args[0]
    dtype = kwargs.get("dtype")
    spec = src._spec
    truncates = dtype is not None and not get_platform().is_floating_dtype(dtype)
    if truncates and any(p.is_partial() for p in spec.placements):
        spec = spec.with_placements(grad_placements(spec.placements))
        src = as_layout(src, spec)
    local = func(src._local_tensor, *args[1:], **kwargs)
    return DTensor._make(local, spec)


def _like(func, args, kwargs):
    src = args[0]
    local = func(src._local_tensor, *args[1:], **kwargs)
    return DTensor._make(local, src._spec.with_placements(grad_placements(src._spec.placements)))


def _new_like(func, args, kwargs):
    """new_empty_strided / new_zeros ... of the DTensor's own global size keep its layout."""
    src, size = args[0], tuple(args[1])
    if size != tuple(src.shape):
        return _fallback(func, args, kwargs)
    spec = src._spec.with_placements(grad_placements(src._spec.placements))
    rest = args[2:]
    if _op_name(func) == "new_empty_strided":
        rest = (_contiguous_strides(spec.local_shape),) + tuple(args[3:])  # local shard: contiguous
    local = func(src._local_tensor, list(spec.local_shape), *rest, **kwargs)
    return DTensor._make(local, spec)


def _contiguous_strides(shape):
    strides, acc = [], 1
    for size in reversed(shape):
        strides.append(acc)
        acc *= max(size, 1)
    return list(reversed(strides))


def _fill(func, args, kwargs):
    target = args[0]
    name = _op_name(func)
    if name == "copy_":
        func(target._local_tensor, copy_source(args[1], target._spec), *args[2:], **kwargs)  # broadcasts
        return target
    if name == "fill_" and any(p.is_partial() for p in target._spec.placements):
        raise ValueError(f"fill_ on a Partial DTensor {target._spec.placements} is ambiguous; "
                         f"redistribute it to Replicate first")
    func(target._local_tensor, *args[1:], **kwargs)
    return target


def _pointwise(func, args, kwargs):
    if _is_inplace(func) and not isinstance(args[0], DTensor):
        # a plain tensor written with DTensor operands (``t.mul_(dt)``): it holds the full value on
        # every rank, which the fallback computes from the gathered operands
        return _fallback(func, args, kwargs)
    leaves, structure = tree_flatten((args, kwargs))
    mesh = common_mesh(leaves, _op_name(func))
    specs = [_as_spec(x, mesh) for x in leaves]
    dt_specs = [s for s in specs if s is not None]
    inplace = _is_inplace(func)
    out_shape = tuple(args[0].shape) if inplace else \
        get_platform().broadcast_shapes(*[s.shape for s in dt_specs])
    operands = [_as_spec(a, mesh) for a in args if not isinstance(a, (str, type(None)))]
    name = linearity_name(_op_name(func), kwargs)
    targets, out = elementwise_strategy(name, dt_specs, operands, out_shape, mesh.ndim)
    it = iter(targets)
    locals_ = [_move(x, s.with_placements(next(it))) if s is not None else x for x, s in zip(leaves, specs)]
    in_own_layout = inplace and out == args[0]._spec.placements
    if in_own_layout:
        locals_[0] = args[0]._local_tensor  # the target's own shard is the one written
    local_args, local_kwargs = tree_unflatten(locals_, structure)
    result = func(*local_args, **local_kwargs)
    if in_own_layout:
        return args[0]
    if inplace:
        # computed in another layout (e.g. a Partial target of a non-linear op is reduced first):
        # lay the value out as the target is, so its placements never change under the user
        target = args[0]
        moved = DTensor._make(local_args[0], target._spec.with_placements(out))
        target._local_tensor.copy_(as_layout(moved, target._spec)._local_tensor)
        return target
    return _wrap_outputs(result, mesh, lambda i: out, lambda i, leaf: out_shape)


def _foreach(func, args, kwargs):
    """_foreach_* ops (optimizers, clip_grad_norm_): each list position is dispatched as its
    single-tensor op (foreach.py)."""
    return run_foreach(func, args, kwargs, dispatch_aten, _fallback)


def _fallback(func, args, kwargs):
    leaves, structure = tree_flatten((args, kwargs))
    mesh = common_mesh(leaves, _op_name(func))
    # an op no interceptor can pass or take over: refused; with none, an aten-level rule may run it
    if screen(_op_name(func), leaves) is None:
        result = run_by_rule(func, args, kwargs)
        if result is not NotImplemented:
            return result
    report_missing_rule(str(getattr(func, "__name__", func)))
    if get_platform().is_grad_enabled():
        for leaf in leaves:  # a leaf's gradient keeps the leaf's placements, via this path too
            if isinstance(leaf, DTensor):
                ensure_leaf_grad_layout(leaf)
    replicate = (Replicate(),) * mesh.ndim
    full = [_move(x, x._spec.with_placements(replicate)) if isinstance(x, DTensor) else x for x in leaves]
    local_args, local_kwargs = tree_unflatten(full, structure)
    result = func(*local_args, **local_kwargs)
    _write_full_values(func, args, kwargs, local_args, local_kwargs)
    if _is_inplace(func):
        return args[0]
    return _wrap_outputs(result, mesh, lambda i: replicate, lambda i, leaf: tuple(leaf.shape))


def _gathered(spec, dim):
    """The placements with every shard of tensor dim ``dim`` replicated (other shards kept)."""
    return tuple(Replicate() if p.is_shard(dim) else p for p in spec.placements)


def _slice_layout(spec, args):
    """slice(self, dim, start, end, step): (source placements, output placements, output shape).
    A slice of a sharded dim gathers that dim, unless it is the whole dim."""
    dim = (args[1] if len(args) > 1 else 0) % spec.ndim
    bounds = [args[i] if len(args) > i else None for i in (2, 3, 4)]
    span = range(*slice(*bounds).indices(spec.shape[dim]))
    whole = span == range(spec.shape[dim])
    source = spec.placements if whole else _gathered(spec, dim)
    return source, source, spec.shape[:dim] + (len(span),) + spec.shape[dim + 1:]


def _select_layout(spec, args):
    """select(self, dim, index): the dim is gathered; later shards move down one dim."""
    dim = args[1] % spec.ndim
    source = _gathered(spec, dim)
    out = tuple(p.with_dim(p.dim - 1) if p.is_shard() and p.dim > dim else p for p in source)
    return source, out, spec.shape[:dim] + spec.shape[dim + 1:]


def _unsqueeze_layout(spec, args):
    """unsqueeze(self, dim) (``x[None]``): shards at or after the new dim move up one."""
    dim = args[1] % (spec.ndim + 1)
    out = tuple(p.with_dim(p.dim + 1) if p.is_shard() and p.dim >= dim else p for p in spec.placements)
    return spec.placements, out, spec.shape[:dim] + (1,) + spec.shape[dim:]


_INDEX_VIEWS = {"slice": _slice_layout, "select": _select_layout, "unsqueeze": _unsqueeze_layout}


def _view(func, args, kwargs):
    """An aten view op. Indexing (slice, select, unsqueeze) runs on the shard, after gathering the indexed dim
    if a mesh dim splits it; other views are computed on the replicated value. A result that does
    not share memory with the input (or is a view of such a copy) remembers how to write an
    in-place change back into the input (writeback.py)."""
    base = args[0]
    layout_of = _INDEX_VIEWS.get(_op_name(func))
    if layout_of is not None and isinstance(base, DTensor) and not kwargs:
        source, placements, shape = layout_of(base._spec, args)
        spec = base._spec
        moved = base if source == spec.placements else as_layout(base, spec.with_placements(source))
        local = func(moved._local_tensor, *args[1:])
        result = DTensor._make(local, DTensorSpec(spec.mesh, placements, shape))
        if moved is base and not writeback.is_marked(base):  # a true view of the shard
            return get_platform().alias_view_wrappers(func, args, kwargs, result)
    else:
        result = _fallback(func, args, kwargs)
    rest = args[1:]
    outs, _ = tree_flatten(result)
    for i, out in enumerate(outs):
        if isinstance(out, DTensor):
            region = (lambda full, i=i: tree_flatten(func(full, *rest, **kwargs))[0][i])
            writeback.mark(out, base, region, autograd_view=True)
    return get_platform().alias_view_wrappers(func, args, kwargs, result)


def _index_backward(func, args, kwargs):
    """slice_backward / select_backward (the gradients of indexing): each rank pads its own piece of
    the gradient into its piece of the input's shape, shards staying on their dims. A gradient split
    along the sliced dim itself takes the fallback (its pieces do not line up with the input's)."""
    grad = args[0]
    if not isinstance(grad, DTensor) or kwargs:
        return _fallback(func, args, kwargs)
    spec, sizes, dim = grad._spec, tuple(args[1]), args[2] % len(args[1])
    if _op_name(func) == "select_backward":
        placements = tuple(p.with_dim(p.dim + 1) if p.is_shard() and p.dim >= dim else p
                           for p in spec.placements)
    elif any(p.is_shard(dim) for p in spec.placements):
        return _fallback(func, args, kwargs)
    else:
        placements = spec.placements
    out_spec = DTensorSpec(spec.mesh, placements, sizes)
    local = func(grad._local_tensor, list(out_spec.local_shape), *args[2:])
    return DTensor._make(local, out_spec)


def _random(func, args, kwargs):
    """Random ops draw what one device would draw under the same seed: every rank draws the whole
    tensor (the ranks' generators must be seeded alike, as for PyTorch DTensor) and keeps its own
    piece of the result and of every argument the op writes (an in-place fill, rrelu's noise)."""
    leaves, structure = tree_flatten((args, kwargs))
    mesh = common_mesh(leaves, _op_name(func))
    full = [_move(x, _replicated(x._spec)) if isinstance(x, DTensor) else x for x in leaves]
    local_args, local_kwargs = tree_unflatten(full, structure)
    result = func(*local_args, **local_kwargs)
    _write_full_values(func, args, kwargs, local_args, local_kwargs)
    if _is_inplace(func):
        return args[0]
    like = args[0]._spec if isinstance(args[0], DTensor) else None
    replicated = (Replicate(),) * mesh.ndim
    return _wrap_outputs(result, mesh, lambda i: replicated, lambda i, leaf: tuple(leaf.shape),
                         relayout=lambda out: _keep_layout(out, like))


def _replicated(spec):
    return spec.with_placements((Replicate(),) * spec.mesh.ndim)


def _keep_layout(out, like):
    """A replicated random output of the input's shape takes the input's (non-partial) layout."""
    if like is None or tuple(out.shape) != tuple(like.shape):
        return out
    return as_layout(out, like.with_placements(grad_placements(like.placements)))


def _lazy_bit(func, args, kwargs):
    """_conj / _neg_view only set a bit on the tensor; a DTensor's wrapper cannot carry it for its
    shard, so the shard's values are conjugated (negated) instead: the same values, no bit."""
    src = args[0]
    return DTensor._make(get_platform().materialize(func(src._local_tensor, *args[1:], **kwargs)), src._spec)


def _reshape_in_place(func, args, kwargs):
    return reshape_in_place(_op_name(func), func, args, kwargs)


_HANDLERS = {"alias": _alias, "like": _like, "new_like": _new_like, "fill": _fill, "pointwise": _pointwise,
             "foreach": _foreach, "random": _random, "view": _view, "reshape_in_place": _reshape_in_place,
             "index_backward": _index_backward, "lazy_bit": _lazy_bit}


def dispatch_aten(func: Any, args: Any, kwargs: Any) -> Any:
    user = user_op_function(func)
    if user is not None:  # register_sharding of this op: the user's strategy, not the fallback
        return run_user_op(user, func, args, kwargs)
    kind = get_platform().aten_kind(func)
    if kind in ("pointwise", "fill") and _mutates_others(func, args, kwargs):
        kind = None  # out= variants and the like: the fallback writes every written argument
    written = [t for t in _written_dtensors(func, args, kwargs)]
    for target in written:
        writeback.check_writable(target)
    result = _HANDLERS.get(kind, _fallback)(func, args, kwargs)
    for target in written:
        writeback.write_back(target)
    return result


def _written_dtensors(func, args, kwargs):
    for pos, key in _written(func, args, kwargs):
        target = args[pos] if key is None else kwargs.get(key)
        for t in target if isinstance(target, (list, tuple)) else [target]:
            if isinstance(t, DTensor):
                yield t
