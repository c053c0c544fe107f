"""Custom backward on MindSpore: ``make_autograd_function`` (core's from_local / to_local /
redistribute, ring attention..., and the differentiable collectives of
``platform/differentiable_collectives.py``).

It is built on MindSpore's PyNative custom-backward ``Function``
(``mindspore.common._grad_function._Function``: ``forward(ctx, *args)`` runs without recording,
``backward(ctx, *grads)`` returns one gradient per input).

DTensors and MindSpore's autograd
---------------------------------
MindSpore's engine only sees plain tensors: a DTensor argument is passed to the Function as its
local shard, and a DTensor result is re-wrapped around the Function's output. The engine therefore
carries a DTensor's gradient as a bare local tensor, without the placements that say what that
local tensor means (this rank's shard of the gradient, the whole replicated gradient, or a partial
sum). The layout of a gradient is recorded beside the DTensor instead, in a small ``_GradSlot``
shared by the DTensor's producer (the Function that returned it) and its consumers:

* A DTensor consumed by exactly one Function: the consumer's backward stores the placements of the
  gradient it returns in the slot, and the producer's backward reads them. Nothing is converted,
  so e.g. the Partial gradient of an all-gathered K reaches the all-gather's backward as Partial
  and becomes one reduce-scatter, as on torch.
* A DTensor consumed several times: the engine sums the contributions, so they must be in one
  layout; every consumer converts its contribution to the canonical gradient layout of the
  DTensor (its own placements, Partial -> Replicate) before returning it. This can cost one
  all-reduce per use where torch sums the partial contributions first and reduces once.
* A leaf DTensor (no producer: a parameter, or a DTensor made without autograd): consumers always
  return the canonical layout, which is what PyTorch DTensor gives a leaf's ``.grad``.
"""
try:
    from mindspore.common._grad_function import _Function
except ImportError as exc:  # pragma: no cover - older MindSpore
    raise ImportError("hyper_parallel's MindSpore platform needs MindSpore's PyNative custom-backward "
                      "Function (mindspore.common._grad_function; tested with MindSpore 2.10.0)"
                      ) from exc

from typing import Any
from hyper_parallel.platform.mindspore.dtensor_base import MindSporeDTensorBase


class _GradSlot:
    __slots__ = ("consumers", "grad_spec")

    def __init__(self):
        self.consumers = 0
        self.grad_spec = None


def _is_dtensor(x):
    return isinstance(x, MindSporeDTensorBase)


def _grad_for_input(dtensor, grad):
    """The local gradient to hand to MindSpore for DTensor input ``dtensor`` (see module doc)."""
    if grad is None:
        return None
    slot = getattr(dtensor, "_hp_gslot", None)
    if _is_dtensor(grad) and slot is not None and slot.consumers == 1:
        slot.grad_spec = grad._spec
        return grad._local_tensor
    target = dtensor._hp_grad_spec()
    if _is_dtensor(grad) and grad._spec == target:
        return grad._local_tensor
    return type(dtensor)._hp_as_layout(grad, target)._local_tensor


def _wrap_grad(proto, grad):
    """The DTensor gradient of output ``proto`` whose local gradient is ``grad``."""
    if grad is None:
        return None
    slot = proto._hp_gslot
    spec = slot.grad_spec if (slot.consumers == 1 and slot.grad_spec is not None) else proto._hp_grad_spec()
    return type(proto)._make(grad, spec)


class _Call:
    """One call of a function made by make_autograd_function: which arguments are tensors."""

    __slots__ = ("args", "tensor_pos", "outputs", "single", "ctx")

    def __init__(self, args):
        self.args = args
        self.tensor_pos = [i for i, a in enumerate(args) if _is_dtensor(a) or _is_plain_tensor(a)]
        self.outputs = None
        self.single = True


class _Ctx:
    """The ctx of a call that records no graph."""

    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors


def _differentiable(tensor):
    import mindspore as ms
    return tensor.dtype in (ms.float16, ms.float32, ms.float64, ms.bfloat16, ms.complex64, ms.complex128)


def _is_plain_tensor(x):
    import mindspore as ms
    return isinstance(x, ms.Tensor) and not _is_dtensor(x)


def make_autograd_function(name: str, forward: Any, backward: Any) -> Any:
    def fn_forward(ctx, call, *tensors):
        ctx._hp_call = call
        out = forward(ctx, *call.args)
        call.single = not isinstance(out, tuple)
        outs = (out,) if call.single else tuple(out)
        call.outputs = outs
        locals_ = tuple(o._local_tensor if _is_dtensor(o) else o for o in outs)
        return locals_[0] if call.single else locals_

    def fn_backward(ctx, *grads):
        call = ctx._hp_call
        wrapped = [_wrap_grad(o, g) if _is_dtensor(o) else g for o, g in zip(call.outputs, grads)]
        results = backward(ctx, *wrapped)
        if not isinstance(results, tuple):
            results = (results,)
        out = []
        for i in call.tensor_pos:
            arg, grad = call.args[i], results[i] if i < len(results) else None
            if _is_dtensor(arg):
                out.append(_grad_for_input(arg, grad))
            else:
                out.append(grad._local_tensor if _is_dtensor(grad) else grad)
        return (None,) + tuple(out)

    cls = type(name, (_Function,), {"forward": staticmethod(fn_forward),
                                    "backward": staticmethod(fn_backward)})

    def apply(*args):
        call = _Call(args)
        tensors = [args[i]._local_tensor if _is_dtensor(args[i]) else args[i] for i in call.tensor_pos]
        if not any(_differentiable(t) for t in tensors):
            # bool / integer values carry no gradient; MindSpore would still call the backward of
            # an *empty* one, on the ranks whose shard is empty only, desynchronising collectives
            return forward(_Ctx(), *args)
        result = cls.apply(call, *tensors)
        results = (result,) if call.single else tuple(result)
        final = []
        for proto, local in zip(call.outputs, results):
            if _is_dtensor(proto):
                wrapped = type(proto)._make(local, proto._spec)
                extra = {k: v for k, v in vars(proto).items() if k not in ("_local_tensor", "_spec")}
                vars(wrapped).update(extra)
                wrapped._hp_gslot = _GradSlot()
                final.append(wrapped)
            else:
                final.append(local)
        for i in call.tensor_pos:
            slot = getattr(args[i], "_hp_gslot", None) if _is_dtensor(args[i]) else None
            if slot is not None:
                slot.consumers += 1
        call.outputs = tuple(final)   # backward reads the gradient slots of what callers got
        return final[0] if call.single else tuple(final)

    apply.__name__ = name
    return apply
