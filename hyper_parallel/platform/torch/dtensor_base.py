"""The torch side of DTensor: a wrapper tensor subclass that forwards both dispatch levels to core.

``__torch_function__`` sees user-level calls (``F.linear``, ``Tensor.view``...) and hands the ones
with a sharding rule to core, which runs them on local shards under ordinary autograd.
``__torch_dispatch__`` sees the aten ops that reach a DTensor without such a rule: autograd-engine
internals (gradient accumulation, ``ones_like`` for ``backward()``), optimizer updates and
in-place methods.
"""
import functools

import torch

from hyper_parallel.platform.torch.compile_boundary import dynamo_compiling, eager_boundary
from hyper_parallel.platform.torch.op_names import build_op_names

OP_NAMES = build_op_names()


def _rebuild_dtensor(local, mesh_desc, placements, shape, requires_grad):
    """Unpickle a DTensor (its ``__reduce_ex__``): plain data only, hence on the safe list below."""
    if TorchDTensorBase._hp_concrete is None:
        # a fresh process that has not used hyper_parallel yet: its public entry point (the
        # package's lazy export, never core directly) defines the DTensor class
        import hyper_parallel
        hyper_parallel.DTensor  # noqa: B018 - imported for its registration
    return TorchDTensorBase._hp_concrete._hp_rebuild(local, mesh_desc, placements, shape, requires_grad)


torch.serialization.add_safe_globals([_rebuild_dtensor])  # torch.load(weights_only=True) accepts DTensors


@functools.lru_cache(maxsize=4096)
def _contiguous_strides(shape):
    strides, acc = [], 1
    for size in reversed(shape):
        strides.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(strides))


def _global_strides(local, shape):
    """The wrapper's strides: those of a dense global tensor whose dims are laid out in the order of
    the shard's (a transposed / permuted shard gives the strides torch gives the transposed full
    tensor, so ``stride()`` and ``is_contiguous()`` agree with it). A contiguous shard, the common
    case, gives contiguous strides without sorting."""
    if local.is_contiguous() or len(shape) != local.dim():
        return _contiguous_strides(shape)
    stride = local.stride()
    order = sorted(range(len(shape)), key=lambda d: stride[d], reverse=True)  # stable: ties keep dim order
    out, acc = [0] * len(shape), 1
    for d in reversed(order):
        out[d] = acc
        acc *= max(shape[d], 1)
    return tuple(out)


_TORCH_FUNCTION_ON = torch._C._is_torch_function_enabled
_TORCH_FUNCTION_MODE = torch._C._is_torch_function_mode_enabled
# private C API the stubs do not declare
_SET_TORCH_FUNCTION = torch._C._set_torch_function_state  # type: ignore[attr-defined]
_ENABLED, _SUBCLASSES_OFF = (torch._C._TorchFunctionState.ENABLED,  # type: ignore[attr-defined]
                             torch._C._TorchFunctionState.SUBCLASSES_DISABLED)  # type: ignore[attr-defined]


@eager_boundary
def _eager_torch_function(cls, func, args, kwargs):
    """A DTensor call reached while dynamo traces: run eagerly (compile_boundary.py)."""
    return cls.__torch_function__(func, (cls,), args, kwargs)


@eager_boundary
def _eager_operator(dunder, self, other, rest, kwargs):
    return getattr(self, dunder.__name__)(other, *rest, **kwargs)


def _operator(dunder, func):
    """``x + y`` (``dunder``) on a DTensor: torch would parse the arguments and enter
    ``__torch_function__`` with ``func`` (``Tensor.add``), which costs as much as the rest of a
    cache hit. This asks core's fast path first, as ``__torch_function__`` would, and takes torch's
    route whenever that is not a plain hit, or torch functions are off or a mode is active (where
    torch's own dispatch differs). Reflected forms (``__radd__``) are left alone: defining them
    would make Python prefer them for ``tensor + dtensor``."""
    name = OP_NAMES[func]

    def method(self, other, *rest, **kwargs):
        if dynamo_compiling():
            return _eager_operator(dunder, self, other, rest, kwargs)
        if _TORCH_FUNCTION_ON() and not rest and not kwargs and not _TORCH_FUNCTION_MODE():
            # DisableTorchFunctionSubclass as a state switch: the state was ENABLED (checked above)
            _SET_TORCH_FUNCTION(_SUBCLASSES_OFF)
            try:
                result = type(self)._hp_function(name, func, (self, other), None, True)
            finally:
                _SET_TORCH_FUNCTION(_ENABLED)
            if result is not NotImplemented:
                return result
        return dunder(self, other, *rest, **kwargs)
    method.__name__ = dunder.__name__
    return method


_DATA_SET = torch.Tensor.data.__set__  # type: ignore[attr-defined]  # the property's setter


def _set_data(dtensor, value):
    """``dtensor.data = value``, as ``Module.to(dtype)`` / ``.double()`` / ``.to_empty()`` assign each
    converted parameter: torch's setter would change the wrapper's dtype and shape but keep the old
    local shard, so the parameter would say float64 and compute in float32. The shard and the layout
    are taken from ``value`` with the wrapper's metadata."""
    if not isinstance(value, TorchDTensorBase):
        raise ValueError(f"dtensor.data = {type(value).__name__}: a DTensor's data can only be another "
                         f"DTensor (its shard and layout come with it); build one with distribute_tensor / "
                         f"DTensor.from_local, or write into dtensor.to_local() in place")
    with torch._C.DisableTorchFunctionSubclass():
        _DATA_SET(dtensor, value)
    dtensor._local_tensor, dtensor._spec = value._local_tensor, value._spec


class TorchDTensorBase(torch.Tensor):
    """Subclassed by core's ``DTensor`` (core/dtensor/dtensor.py), which provides the hooks this class
    calls (``_hp_function``, ``_hp_aten``, ``_hp_fused``, ``_hp_describe``, ``_hp_checkpoint_box``,
    ``_hp_rebuild``): the platform never imports core."""

    __slots__ = ()
    _hp_concrete = None  # core's DTensor, which registers itself by subclassing

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        TorchDTensorBase._hp_concrete = cls
        # optimizers and clip_grad_norm_ take their foreach path only for listed types (PyTorch
        # lists its own DTensor the same way); every position is then dispatched per shard
        from torch.optim import optimizer
        from torch.utils import _foreach_utils
        for types in (optimizer._foreach_supported_types, _foreach_utils._foreach_supported_types):
            if cls not in types:
                types.append(cls)

    @staticmethod
    def __new__(cls, local_tensor, global_shape, requires_grad=False):
        if local_tensor.layout != torch.strided:
            raise NotImplementedError(f"a DTensor holds strided shards; this op produced a "
                                      f"{local_tensor.layout} tensor. Call it on dt.full_tensor() (or "
                                      f"dt.to_local()) instead")
        shape = tuple(global_shape)
        return torch.Tensor._make_wrapper_subclass(
            cls, shape, strides=_global_strides(local_tensor, shape), dtype=local_tensor.dtype,
            device=local_tensor.device, layout=local_tensor.layout, requires_grad=requires_grad)

    # ``__new__`` for core's dispatch fast path, called as ``_hp_fast_new(cls, global_shape,
    # dtype=, device=)``: it wraps only results of calls that went through ``__new__`` before with
    # the same inputs (so strided), with contiguous global strides (the default) and no gradient
    # flag. The C function itself, not a Python frame around it: this runs once per op
    _hp_fast_new = staticmethod(torch.Tensor._make_wrapper_subclass)

    # grad mode, for core's dispatch fast path: the C function itself, not a Python frame around it
    _hp_grad_enabled = staticmethod(torch.is_grad_enabled)
    # of a plain tensor (a local result); the stubs type the descriptor as its value
    _hp_requires_grad = torch.Tensor.requires_grad.__get__  # type: ignore[attr-defined]
    # of a DTensor, read under DisableTorchFunctionSubclass
    _hp_is_leaf = torch.Tensor.is_leaf.__get__  # type: ignore[attr-defined]
    _hp_detach = torch.Tensor.detach   # a shard's alias without history, for the fast path's nodes

    # the Python operators whose torch function is the plain method (found by probing torch)
    __add__ = _operator(torch.Tensor.__add__, torch.Tensor.add)
    __sub__ = _operator(torch.Tensor.__sub__, torch.Tensor.sub)
    __mul__ = _operator(torch.Tensor.__mul__, torch.Tensor.mul)
    __truediv__ = _operator(torch.Tensor.__truediv__, torch.Tensor.div)
    __matmul__ = _operator(torch.Tensor.__matmul__, torch.Tensor.matmul)

    def __reduce_ex__(self, protocol):
        """Pickled as (this rank's piece, mesh description, placements, global shape)."""
        return _rebuild_dtensor, self._hp_describe()

    # ------------------------------------------------ torch.distributed.checkpoint's protocol
    # DCP asks a tensor subclass for the global block(s) its rank holds; from them it writes the
    # pieces (replicated copies deduplicated) and, on load, reads whatever saved pieces overlap
    # the target's block: any mesh / placements, or plain tensors in one process.
    def _hp_box(self):
        box = self._hp_checkpoint_box()
        return None if box is None or 0 in box[1] else box

    def __create_write_items__(self, fqn, obj):
        from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, MetadataIndex,
                                                           TensorProperties)
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
        box = self._hp_box()
        if box is None:
            return []
        offsets, sizes = (torch.Size(b) for b in box)
        return [WriteItem(index=MetadataIndex(fqn, offsets), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(
                              chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
                              properties=TensorProperties.create_from_tensor(self._local_tensor),
                              size=torch.Size(self.shape)))]

    def __create_chunk_list__(self):
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
        box = self._hp_box()
        if box is None:
            return []
        return [ChunkStorageMetadata(offsets=torch.Size(box[0]), sizes=torch.Size(box[1]))]

    def __get_tensor_shard__(self, index):
        box = self._hp_box()
        if box is None or (index.offset is not None and tuple(index.offset) != box[0]):
            raise ValueError(f"{index.fqn}: this rank holds no checkpoint piece at offset {index.offset}")
        return self._local_tensor

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if dynamo_compiling():
            return _eager_torch_function(cls, func, args, kwargs)
        name = OP_NAMES.get(func)
        if name is not None:
            # core reads DTensor attributes (dtype, requires_grad...) while it dispatches: with the
            # subclass's torch function off, each read is a plain attribute read. ``kwargs`` may be
            # None (core's fast path tests it rather than building an empty dict per op)
            with torch._C.DisableTorchFunctionSubclass():
                result = cls._hp_function(name, func, args, kwargs)
            if result is not NotImplemented:
                return result
        if func == _DATA_SET:
            return _set_data(*args)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__.startswith("_fused_"):  # fused optimizer steps
            return cls._hp_fused(func, args, kwargs or {})
        return cls._hp_aten(func, args, kwargs or {})
