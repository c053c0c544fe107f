"""``tensor OP dtensor``: a plain Tensor (or Parameter) on the left of a Python operator.

Python evaluates ``x + d`` as ``x.__add__(d)``. MindSpore's Tensor operators ``+ - * / ** % & | ^``
(and their in-place forms) are C methods that look for ``__fallback__`` on the *left* operand only,
so with a plain Tensor there they raised "Cannot found __fallback__ attr from object Tensor":
residual code ``x + sublayer(x)``, ``self.weight * h`` (a Parameter on the left), and MindSpore's
own functions built from operators (``ops.remainder``, ``ops.fmod``) broke. Python would call the
DTensor's reflected method first only if DTensor overrode it *and* subclassed the left operand's
type, which a Parameter is not.

So those methods of ``mindspore.Tensor`` (Parameters inherit them) are replaced by thin wrappers:
when the right operand is a DTensor and the left one is not, the operator goes to the DTensor's
``__fallback__`` with the operands in their order, under the op name the C method uses for two
tensors (the same sharding rule and local kernel as ``d + x``, so values and gradients equal one
process); any other call goes straight to the C method. An in-place operator whose left operand is
a plain Tensor cannot hold a distributed result, so it raises (PyTorch's DTensor refuses it too).
``@``, ``//`` and the comparisons are Python methods that call functional ops, which find the
DTensor among all arguments: unchanged.
"""
import mindspore as ms
from mindspore._c_expression import TensorPy

from hyper_parallel.platform.mindspore.dtensor_base import MindSporeDTensorBase

# Python method -> the MindSpore op its C method runs for two tensors (core's rule is keyed by it)
BINARY = {"__add__": "AddExt", "__sub__": "SubExt", "__mul__": "Mul", "__truediv__": "Div",
          "__pow__": "Pow", "__mod__": "RemainderTensorTensor", "__and__": "BitwiseAndTensor",
          "__or__": "BitwiseOrTensor", "__xor__": "BitwiseXorTensor"}
INPLACE = {"__iadd__": "+=", "__isub__": "-=", "__imul__": "*=", "__itruediv__": "/=", "__imod__": "%=",
           "__ifloordiv__": "//="}


class _TensorMethod:
    """The C method as the operator ``__fallback__`` receives: ``name`` for the op table, and called
    on the local (plain) tensors it runs exactly what ``x OP y`` runs on one process."""

    __slots__ = ("name", "_method")

    def __init__(self, name, method):
        self.name, self._method = name, method

    def __call__(self, *args, **kwargs):
        return self._method(*args, **kwargs)


def _binary(method, op):
    def operator(self, other):
        if isinstance(other, MindSporeDTensorBase) and not isinstance(self, MindSporeDTensorBase):
            return type(other).__fallback__(op, (self, other), {})
        return method(self, other)
    operator._hp_original = method
    return operator


def _inplace(method, symbol):
    def operator(self, other):
        if isinstance(other, MindSporeDTensorBase) and not isinstance(self, MindSporeDTensorBase):
            raise NotImplementedError(
                f"x {symbol} d with a plain Tensor x and a DTensor d: the plain tensor cannot hold the "
                f"distributed result; write x = x {symbol[:-1]} d (a DTensor)")
        return method(self, other)
    operator._hp_original = method
    return operator


def install() -> None:
    """Once per process: the wrappers on ``mindspore.Tensor`` (see the module docstring)."""
    for attr, ms_name in BINARY.items():
        current = ms.Tensor.__dict__.get(attr)
        if current is None or getattr(current, "_hp_original", None) is None:
            method = getattr(TensorPy, attr)
            setattr(ms.Tensor, attr, _binary(method, _TensorMethod(ms_name, method)))
            # a DTensor on the left keeps the C method: no wrapper on its hot path
            setattr(MindSporeDTensorBase, attr, method)
    for attr, symbol in INPLACE.items():
        current = ms.Tensor.__dict__.get(attr)
        if current is None or getattr(current, "_hp_original", None) is None:
            method = getattr(TensorPy, attr)
            setattr(ms.Tensor, attr, _inplace(method, symbol))
            setattr(MindSporeDTensorBase, attr, method)
