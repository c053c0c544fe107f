"""The MindSpore entry points that take a DTensor's data without asking it anything.

A DTensor's own data is a placeholder without data (dtensor_base.py ``_placeholder``: a tensor of
unknown rank, so that any kernel reading it fails instead of returning an empty result). These paths
took it silently, because MindSpore's C++ asks the object nothing a DTensor could answer:

* ``ms.Tensor(dt)`` / ``ms.tensor(dt)`` / ``ms.Tensor(input_data=dt, dtype=...)``: the constructor
  copies the placeholder (it only runs isinstance checks in ``mindspore.common.tensor._init``, which
  the C++ constructor looks up on every call). Refused here with the fix.
* Old-style primitives given a list or tuple holding a DTensor (``ops.stack``, ``ops.addn``,
  ``ops.Stack()``, ``mindspore.numpy.stack``...): their argument conversion looks for ``__fallback__``
  only on top-level arguments, so the kernel read the placeholders (``ops.stack([dt, dt])`` returned
  shape (2, 0)). Every old-style primitive runs through ``_PyNativeExecutor.run_op_async`` (or
  ``real_run_op``); there a sequence holding a DTensor is handed to the DTensor's ``__fallback__`` in the
  form MindSpore uses for old-style calls, ``(primitive, name, args)``: the op then runs through its
  sharding rule, or core's replicated fallback, and gives what one process gives on the full tensors.

* ``ms.grad`` / ``ms.value_and_grad`` with respect to a DTensor argument differentiate the object,
  i.e. its placeholder (the gradient was an empty tensor; with no data MindSpore now fails building
  zeros of its shape): the failure is re-raised naming the fix (``_PyNativeExecutor.grad``).

``Parameter.set_data(dt)`` / ``tensor.assign_value(dt)`` ask the DTensor ``stub`` (MindSpore's
protocol for lazy tensors), which dtensor_base.py answers with the error; ``plain.copy_(dt)``:
reflected_ops.py.
"""
from typing import Any
import functools

import mindspore as ms

from hyper_parallel.platform.mindspore.dtensor_base import MindSporeDTensorBase, NO_COPY

TENSOR_OF_DTENSOR = NO_COPY.format(what="ms.Tensor(dtensor) / ms.tensor(dtensor)").replace(
    "ms.Parameter(dt.to_local())", "ms.Tensor(dt.to_local())")


class _LegacyCall:
    """The old-style primitive's run as ``__fallback__`` receives it: ``name`` for the op table;
    called on local tensors, ``(primitive, name, args)``, it runs exactly what MindSpore would have run."""

    __slots__ = ("name", "_run", "_executor")

    def __init__(self, name: str, run: Any, executor: Any) -> None:
        self.name, self._run, self._executor = name, run, executor

    def __call__(self, prim: Any, name: str, args: Any) -> Any:
        return self._run(self._executor, prim, name, args)


def _dtensor_in_sequence(args: Any) -> Any:
    """The first DTensor inside a list / tuple argument (top-level ones find ``__fallback__``)."""
    for value in args:
        if value.__class__ in (list, tuple):
            for item in value:
                if isinstance(item, MindSporeDTensorBase):
                    return item
    return None


def _routed(run: Any) -> Any:
    @functools.wraps(run)
    def run_op(self: Any, prim: Any, name: str, args: Any, *rest: Any) -> Any:
        found = _dtensor_in_sequence(args) if not rest else None
        if found is None:
            return run(self, prim, name, args, *rest)
        return type(found).__fallback__(_LegacyCall(name, run, self), (prim, name, tuple(args)), {})
    run_op._hp_placeholder = True   # type: ignore[attr-defined]
    return run_op


def _refusing_init(init: Any) -> Any:
    @functools.wraps(init)
    def init_(input_data: Any = None, *args: Any, **kwargs: Any) -> Any:
        if isinstance(input_data, MindSporeDTensorBase):
            raise ValueError(TENSOR_OF_DTENSOR)
        return init(input_data, *args, **kwargs)
    init_._hp_placeholder = True   # type: ignore[attr-defined]
    return init_


GRAD_OF_DTENSOR = (
    "{who} with respect to a DTensor argument: MindSpore differentiates the argument object, whose own "
    "data is a placeholder (the shard is dt.to_local()). Differentiate with respect to the local tensor, "
    "e.g. ms.grad(lambda local: f(DTensor.from_local(local, mesh, placements)))(dt.to_local()) (the "
    "gradient of this rank's piece), or keep trained values as Parameters (a parallelized Cell's are)")


def _explained_grad(grad: Any) -> Any:
    """``ms.grad`` / ``value_and_grad`` of DTensor arguments failed in MindSpore building zeros of the
    placeholder's shape ("the 0th dimension of input shape must be greater than or equal to 0"; before
    the placeholder had an unknown rank, the gradient was silently empty): the error says why."""
    @functools.wraps(grad)
    def grad_(self: Any, obj: Any, grad_op: Any, weights: Any, grad_position: Any, has_aux: Any,
              *args: Any) -> Any:
        try:
            return grad(self, obj, grad_op, weights, grad_position, has_aux, *args)
        except (RuntimeError, ValueError, TypeError) as exc:
            found = next((a for a in args if isinstance(a, MindSporeDTensorBase)), None)
            if found is None:
                raise
            raise ValueError(GRAD_OF_DTENSOR.format(who="ms.grad / ms.value_and_grad")) from exc
    grad_._hp_placeholder = True   # type: ignore[attr-defined]
    return grad_


def install() -> None:
    """Once per process: the entry points above (the module docstring)."""
    import sys
    from mindspore.graph.api import _PyNativeExecutor
    if not getattr(_PyNativeExecutor.grad, "_hp_placeholder", False):
        _PyNativeExecutor.grad = _explained_grad(_PyNativeExecutor.grad)
    for attr in ("run_op_async", "real_run_op"):
        current = getattr(_PyNativeExecutor, attr)
        if not getattr(current, "_hp_placeholder", False):
            setattr(_PyNativeExecutor, attr, _routed(current))
    # mindspore.common.tensor, whose _init the C++ constructor looks up on every call (the package
    # attribute ``mindspore.common.tensor`` is a function, so the module is taken from sys.modules)
    module: Any = sys.modules[ms.Tensor.__module__]
    if not getattr(module._init, "_hp_placeholder", False):
        module._init = _refusing_init(module._init)
