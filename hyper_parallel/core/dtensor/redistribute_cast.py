"""``DTensor.redistribute(..., forward_dtype=, backward_dtype=)``: redistribution with casts around
the collectives, with PyTorch's (>= 2.6) semantics.

Forward: the local shard is cast to ``forward_dtype`` *before* the collective (a bf16 all-gather
moves half the bytes of an fp32 one) and the result stays in ``forward_dtype``. Backward: the
gradient is cast to ``backward_dtype`` (default: the input's dtype) before the backward
collective, and the gradient returned to the input is always in the input's dtype, as autograd
requires.
"""
from typing import Any
from hyper_parallel.core.autograd_functions import lazy_autograd_function
from hyper_parallel.core.dtensor.dtensor import DTensor, as_layout
from hyper_parallel.core.dtensor.layout import grad_placements
from hyper_parallel.core.dtensor.redistribute import redistribute_local
from hyper_parallel.platform import get_platform


def _cast(local, dtype):
    return local if dtype is None or local.dtype == dtype else local.to(dtype)


def _forward(ctx, dtensor, placements, forward_dtype, backward_dtype):
    spec = dtensor._spec
    ctx.src, ctx.in_dtype = spec, dtensor._local_tensor.dtype
    ctx.backward_dtype = backward_dtype or ctx.in_dtype
    local = _cast(dtensor._local_tensor, forward_dtype)
    local = redistribute_local(local, spec.mesh, spec.shape, spec.placements, placements)
    return DTensor._make(local, spec.with_placements(placements))


def _backward(ctx, grad):
    target = ctx.src.with_placements(grad_placements(ctx.src.placements))
    if isinstance(grad, DTensor):
        grad = DTensor._make(_cast(grad._local_tensor, ctx.backward_dtype), grad._spec)
    else:
        grad = _cast(grad, ctx.backward_dtype)
    out = as_layout(grad, target)
    return DTensor._make(_cast(out._local_tensor, ctx.in_dtype), out._spec), None, None, None


_fn = lazy_autograd_function("RedistributeCast", _forward, _backward)


class _NoCtx:
    pass


def redistribute_cast(dtensor: Any, placements: Any, forward_dtype: Any, backward_dtype: Any) -> Any:
    """``dtensor`` in ``placements`` (normalised), cast as described above (differentiable)."""
    platform = get_platform()
    if platform.is_grad_enabled() and dtensor.requires_grad:
        return _fn(dtensor, placements, forward_dtype, backward_dtype)
    return _forward(_NoCtx(), dtensor, placements, forward_dtype, backward_dtype)
