"""Multi-tensor ops on DTensors: ``_foreach_*`` (optimizers' foreach path, ``clip_grad_norm_``) and
the fused optimizer steps (``_fused_adam_`` ...).

A foreach op is a list of independent single-tensor ops; each position is dispatched as that op
would be, so every parameter is updated exactly as on one device whatever its layout. A gradient
norm (``_foreach_norm``) is combined from the shards' norms instead of gathering each gradient.
"""
from typing import Any
import math

from hyper_parallel.core.dtensor.dtensor import DTensor, as_layout
from hyper_parallel.core.dtensor.placement_types import Replicate
from hyper_parallel.core.dtensor.spec import DTensorSpec
from hyper_parallel.platform import get_platform


def _returns_nothing(func):
    return get_platform().op_returns_nothing(func)


def run_foreach(func: Any, args: Any, kwargs: Any, dispatch: Any, fallback: Any) -> Any:
    """``dispatch(op, args, kwargs)`` runs one single-tensor aten op on DTensors; ``fallback`` runs
    the whole foreach op on replicated values (for the few without a single-tensor form)."""
    calls = get_platform().foreach_to_single(func, args, kwargs)
    if calls is None:
        result = fallback(func, args, kwargs)
        return None if _returns_nothing(func) else result
    results = []
    for op, item_args, item_kwargs, copy_into_self in calls:
        out = None
        if not isinstance(item_args[0], DTensor):
            # plain parameters share the lists with DTensor ones; a DTensor operand of a plain one
            # (clip_grad_norm_'s coefficient) is used whole, as one device would
            out = op(*[_whole(a) for a in item_args], **{k: _whole(v) for k, v in item_kwargs.items()})
        elif _op_name(op) == "linalg_vector_norm" and isinstance(item_args[0], DTensor):
            out = sharded_norm(op, item_args, item_kwargs)
        if out is None:
            out = dispatch(op, item_args, item_kwargs)
        if copy_into_self:  # aten has no in-place form (``_foreach_maximum_``)
            item_args[0].copy_(out)
            out = item_args[0]
        results.append(out)
    return None if _returns_nothing(func) else results


def _whole(x):
    if not isinstance(x, DTensor):
        return x
    return as_layout(x, x._spec.with_placements((Replicate(),) * x._spec.mesh.ndim))._local_tensor


def _op_name(func):
    return getattr(getattr(func, "overloadpacket", func), "__name__", str(func))


def sharded_norm(op: Any, args: Any, kwargs: Any) -> Any:
    """The p-norm of a whole DTensor from its shards' norms: one all-reduce of a scalar per sharded
    mesh dim, never a gather. None (the caller dispatches normally) for Partial values or a
    ``dim`` argument."""
    dt, ord_ = args[0], (args[1] if len(args) > 1 else 2)
    spec = dt._spec
    if len(args) > 2 or any(p.is_partial() for p in spec.placements):
        return None
    local = op(dt._local_tensor, ord_, **kwargs)
    ord_ = float(ord_)
    for m, p in enumerate(spec.placements):
        if not p.is_shard():
            continue
        group = spec.mesh.get_group(m)
        if math.isinf(ord_):
            local = get_platform().all_reduce(local, group, op="max" if ord_ > 0 else "min")
        elif ord_ == 0:
            local = get_platform().all_reduce(local, group)
        else:
            local = get_platform().all_reduce(local ** ord_, group) ** (1.0 / ord_)
    replicated = DTensorSpec(spec.mesh, (Replicate(),) * spec.mesh.ndim, ())
    return DTensor._make(local, replicated)


def run_fused(func: Any, args: Any, kwargs: Any) -> Any:
    """A fused optimizer step (``_fused_adam_(params, grads, exp_avgs, ...)``): elementwise across
    the lists, so it runs once on the local shards when each position's tensors share the
    parameter's layout (the usual case: state is created ``zeros_like(param)``); a tensor in
    another layout is moved to the parameter's for the step and its new value moved back."""
    params = args[0]
    moved = []
    local_args = []
    for arg in args:
        if not isinstance(arg, (list, tuple)):
            local_args.append(arg._local_tensor if isinstance(arg, DTensor) else arg)
            continue
        column = []
        for param, t in zip(params, arg):
            if not isinstance(t, DTensor):
                column.append(t)
            elif t._spec == param._spec:
                column.append(t._local_tensor)
            else:
                local = as_layout(t, param._spec)._local_tensor
                moved.append((t, local, param._spec))
                column.append(local)
        local_args.append(type(arg)(column))
    func(*local_args, **{k: v._local_tensor if isinstance(v, DTensor) else v for k, v in kwargs.items()})
    for target, local, spec in moved:
        target._local_tensor.copy_(as_layout(DTensor._make(local, spec), target._spec)._local_tensor)
    return None
