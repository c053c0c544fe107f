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
DTensor among all arguments: unchanged. The same holds for indexing a plain tensor with a tuple holding a
DTensor (``x[d_idx, 0]`` read the index's placeholder): it runs replicated (core's fallback); assigning a
DTensor into a plain tensor, or through a DTensor index, raises, as does ``x.copy_(d)``.
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


def _copy_into(method):
    """``x.copy_(d)``: the C method found no ``__fallback__`` on a plain ``x`` ("Cannot found __fallback__
    attr from object Tensor"); the error now names the fix."""
    def copy_(self, src, *args, **kwargs):
        if isinstance(src, MindSporeDTensorBase) and not isinstance(self, MindSporeDTensorBase):
            raise NotImplementedError(
                "x.copy_(d) with a plain Tensor x and a DTensor d: a plain tensor cannot hold the "
                "distributed value; use x.copy_(d.full_tensor()) (the global value) or "
                "x.copy_(d.to_local()) (this rank's shard)")
        return method(self, src, *args, **kwargs)
    copy_._hp_original = method
    return copy_


def _index_dtensor(index):
    """The DTensor inside a tuple / list index (MindSpore's C indexing looks for ``__fallback__`` on a
    tensor index, not inside a tuple: ``x[d_idx, 0]`` read the index's placeholder)."""
    if index.__class__ in (tuple, list):
        return next((i for i in index if isinstance(i, MindSporeDTensorBase)), None)
    return None


def _getitem(method):
    def getitem(self, index):
        found = _index_dtensor(index)
        if found is None:
            return method(self, index)
        return found.__class__._hp_replicated("getitem (MindSpore)", _GetItemOf(method), (self, index), {})
    getitem._hp_original = method
    return getitem


def _setitem(method):
    def setitem(self, index, value):
        if isinstance(value, MindSporeDTensorBase) or _index_dtensor(index) is not None or \
                isinstance(index, MindSporeDTensorBase):
            raise NotImplementedError(
                "x[index] = ... with a plain Tensor x and a DTensor index or value: a plain tensor cannot "
                "hold a distributed value; build the result out of place (ops.where, mint.cat) or use "
                "d.full_tensor()")
        return method(self, index, value)
    setitem._hp_original = method
    return setitem


class _GetItemOf:
    """Plain indexing as core's replicated fallback runs it (on the full index)."""

    __name__ = "getitem"

    def __init__(self, method):
        self._method = method

    def __call__(self, x, index):
        return self._method(x, index)


def install() -> None:
    """Once per process: the wrappers on ``mindspore.Tensor`` (see the module docstring)."""
    for attr, wrap in (("__getitem__", _getitem), ("__setitem__", _setitem)):
        current = ms.Tensor.__dict__.get(attr)
        if current is None or getattr(current, "_hp_original", None) is None:
            setattr(ms.Tensor, attr, wrap(getattr(TensorPy, attr)))
    for attr, ms_name in BINARY.items():
        current = ms.Tensor.__dict__.get(attr)
        if current is None or getattr(current, "_hp_original", None) is None:
            method = getattr(TensorPy, attr)
            setattr(ms.Tensor, attr, _binary(method, _TensorMethod(ms_name, method)))
            # a DTensor on the left keeps the C method: no wrapper on its hot path
            setattr(MindSporeDTensorBase, attr, method)
    current = ms.Tensor.__dict__.get("copy_")
    if current is None or getattr(current, "_hp_original", None) is None:
        method = getattr(TensorPy, "copy_")
        setattr(ms.Tensor, "copy_", _copy_into(method))
        setattr(MindSporeDTensorBase, "copy_", method)
    for attr, symbol in INPLACE.items():
        current = ms.Tensor.__dict__.get(attr)
        if current is None or getattr(current, "_hp_original", None) is None:
            method = getattr(TensorPy, attr)
            setattr(ms.Tensor, attr, _inplace(method, symbol))
            setattr(MindSporeDTensorBase, attr, method)
