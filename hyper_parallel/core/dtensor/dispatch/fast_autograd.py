"""The autograd nodes of the dispatch fast path (fast_path.py), leaner twins of dtensor.py's.

A call with autograd on the full dispatcher builds one ``ToLocal`` node per DTensor input and one
``FromLocal`` node for the output. The fast path builds the same gradients with fewer, cheaper
nodes: one ``ToLocals`` node for all inputs of the call (each input's backward is ``ToLocal``'s:
the gradient wrapped with the input's gradient spec, Partial(sum) where the output's gradient
passed through), and a ``FromLocal`` whose backward is the slow path's own and whose forward wraps
the way the fast path does. On a small op each node costs more than the op itself.

On a platform without the lean hooks (``DTensor._hp_detach``...) the slow path's own nodes run.

``ToLocals`` hands the op detached aliases of the shards rather than views: the op is one
out-of-place call that never exposes them, and a detach costs a third of a view. ``FromLocal``
keeps the slow path's view, since its output is the user's DTensor.
"""
from hyper_parallel.core.dtensor.dtensor import (DTensor, _from_local, _from_local_backward,
                                                 _dense, _input_grad_spec, _to_local)
from hyper_parallel.platform import get_platform

_make = DTensor._make
_new = getattr(DTensor, "_hp_fast_new", None)
_detach = getattr(DTensor, "_hp_detach", None)


def _to_locals_forward(ctx, grad_specs, passthrough, *dtensors):
    ctx.grad_specs = grad_specs
    ctx.passthrough = passthrough
    if _detach is not None:
        return tuple([_detach(d._local_tensor) for d in dtensors])
    return tuple([d._local_tensor.view_as(d._local_tensor) for d in dtensors])


def _to_locals_backward(ctx, *grads):
    passthrough = ctx.passthrough
    return (None, None) + tuple([DTensor._make(_dense(g), _input_grad_spec(spec, passthrough))
                                 for g, spec in zip(grads, ctx.grad_specs)])


def _from_local_forward(ctx, local, spec, passthrough):
    ctx.spec = spec
    ctx.passthrough = passthrough
    ctx.grad_spec = None
    view = local.view_as(local)
    if _new is None or not view.is_contiguous():  # strided: __new__ gives the global strides
        return _make(view, spec)
    obj = _new(DTensor, spec.shape, dtype=view.dtype, device=view.device)
    obj._local_tensor = view
    obj._spec = spec
    return obj


# built at import, not lazily as core's other autograd functions (autograd_functions.py): the fast
# path calls them directly, without a wrapper frame, and which ones exist depends on the platform's
# lean hooks (``_detach``), fixed for the process
_to_locals_fn = get_platform().make_autograd_function("ToLocals", _to_locals_forward, _to_locals_backward)
# named as the slow path's node: ``out.grad_fn`` reads the same either way
_from_local_fn = get_platform().make_autograd_function("FromLocal", _from_local_forward, _from_local_backward)


if _detach is not None:
    # called directly (no wrapper frame): to_locals(grad_specs, passthrough, *dtensors) -> their
    # shards, every DTensor requiring grad under grad mode; from_local(local, spec, passthrough) ->
    # the DTensor of ``local`` (requiring grad, under grad mode)
    to_locals = _to_locals_fn
    from_local = _from_local_fn
else:
    # a platform without the lean hooks (MindSpore, whose autograd bridge has its own Functions):
    # the slow path's nodes themselves, one per input
    def to_locals(grad_specs, passthrough, *dtensors):
        return tuple(_to_local(d, spec, passthrough) for d, spec in zip(dtensors, grad_specs))

    def from_local(local, spec, passthrough):
        return _from_local(local, spec, passthrough)


__all__ = ["from_local", "to_locals"]
