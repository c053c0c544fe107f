"""MindSpore platform (PyNative mode): CPU (``mccl``), Ascend (``hccl``), GPU (``nccl``).

Process groups are in ``groups.py``, raw collectives in ``collectives.py`` (on CPU the missing ones
are emulated with all-gather / all-reduce in ``emulations.py``, whose registry ``capabilities()``
reads), ``make_autograd_function`` in ``autograd.py`` (MindSpore's custom-backward ``Function``; the
differentiable collectives are the shared ones of ``platform/differentiable_collectives.py``), the
DTensor base class (a ``Tensor`` subclass whose ``__fallback__`` hands every MindSpore op on a
DTensor to core's sharding rules) in ``dtensor_base.py``, the op-name table in ``op_names.py``,
shape inference for that table in ``meta.py`` and the attention kernels in ``attention.py``.
"""
from typing import Any
import os
import resource
import types

import numpy as np

import mindspore as ms
from mindspore import mint, ops
from mindspore.common.api import _no_grad, _pynative_executor
from mindspore.communication import GlobalComm, get_rank, init

from hyper_parallel.platform.base import Platform
from hyper_parallel.platform.mindspore import attention as attention_kernels
from hyper_parallel.platform.mindspore import autograd as ag
from hyper_parallel.platform.mindspore import compile_guard
from hyper_parallel.platform.mindspore import meta
from hyper_parallel.platform.mindspore.collectives import Collectives
from hyper_parallel.platform.mindspore.groups import MsGroup
from hyper_parallel.platform.mindspore.training import MindSporeTrainingSupport
from hyper_parallel.platform.mindspore.long_sequence import MindSporeLongSequence
from hyper_parallel.platform.mindspore.compute_state import MindSporeComputeState
from hyper_parallel.platform.mindspore.dtensor_base import MindSporeDTensorBase

_LAUNCHER_ENV = ("MS_ROLE", "MS_WORKER_NUM", "MS_SCHED_HOST", "MS_SCHED_PORT")


# MindSporeTrainingSupport: training.py (DP)
class MindSporePlatform(MindSporeTrainingSupport, MindSporeLongSequence, MindSporeComputeState,
                        Platform):
    name = "mindspore"
    Tensor = ms.Tensor
    Module = ms.nn.Cell
    Parameter = ms.Parameter
    DTensorBase = MindSporeDTensorBase

    def __init__(self) -> None:
        super().__init__()
        if ms.get_context("mode") != ms.PYNATIVE_MODE:
            raise RuntimeError("hyper_parallel on MindSpore needs PyNative mode "
                               "(ms.set_context(mode=ms.PYNATIVE_MODE)); graph mode is not supported")
        self._comm = Collectives(self)
        self._initialized = False

    # ---------------------------------------------------------------- device
    @property
    def device_type(self) -> Any:
        return str(ms.get_context("device_target")).lower()

    @property
    def default_backend(self) -> Any:
        return {"ascend": "hccl", "gpu": "nccl"}.get(self.device_type, "mccl")

    def device(self) -> Any:
        return ms.get_context("device_target")

    def set_device(self, local_rank: Any) -> None:
        if self.device_type != "cpu":
            ms.set_device(ms.get_context("device_target"), int(local_rank))

    def synchronize(self) -> None:
        _pynative_executor.sync()  # PyNative queues ops asynchronously, on CPU too: wait for them
        if self.device_type != "cpu":
            ms.runtime.synchronize()

    def track_peak_memory(self) -> Any:
        """``with platform.track_peak_memory() as m: ...`` then ``m.peak_bytes``."""
        return _PeakMemory(self)

    def peak_memory_bytes(self) -> Any:
        """Peak device memory; on CPU the process's peak resident set (not resettable)."""
        if self.device_type != "cpu":
            return int(ms.runtime.max_memory_allocated())
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    # ---------------------------------------------------------------- capabilities
    def capabilities(self) -> Any:
        """Native collectives and, where a kernel is missing, the registered emulations
        (emulations.py holds their descriptions)."""
        return {"backend": self.default_backend, **self._comm.capabilities()}

    # ---------------------------------------------------------------- process groups
    def init_process_group(self, backend: Any = None, timeout_s: Any = None, **kwargs: Any) -> None:
        if self.is_initialized():
            self._initialized = True
            return
        missing = [k for k in _LAUNCHER_ENV if k not in os.environ]
        if missing and "RANK_TABLE_FILE" not in os.environ:
            raise RuntimeError(f"cannot initialise MindSpore communication: the launcher variables "
                               f"{missing} are not set (start with msrun, or set MS_ROLE=MS_WORKER, "
                               f"MS_WORKER_NUM, MS_NODE_ID, MS_SCHED_HOST, MS_SCHED_PORT and run a "
                               f"scheduler with MS_ROLE=MS_SCHED)")
        init(backend) if backend else init()
        self._initialized = True

    def is_initialized(self) -> Any:
        return self._initialized or bool(GlobalComm.INITED)

    def get_rank(self, group: Any = None) -> Any:
        if group is None:
            return get_rank() if self.is_initialized() else 0
        return self._comm.me(self._comm.resolve(group))

    def get_world_size(self, group: Any = None) -> Any:
        if group is None:
            return len(self._comm.world().ranks) if self.is_initialized() else 1
        return len(self._comm.resolve(group))

    def new_group(self, ranks: Any, timeout_s: Any = None) -> Any:
        """``timeout_s`` is accepted for the shared interface and ignored: MindSpore's collectives
        have no per-group timeout (on CPU they give up after their own fixed ~30 s)."""
        return self._comm.new_group(ranks)

    def group_ranks(self, group: Any) -> Any:
        return self._comm.resolve(group).ranks

    def barrier(self, group: Any = None) -> None:
        group = self._comm.resolve(group)
        if len(group) > 1:
            mint.distributed.barrier(group=group.name)

    def destroy_process_group(self) -> None:
        if self.is_initialized():
            self.barrier()
        self._comm.clear()

    # ---------------------------------------------------------------- autograd plumbing for core
    @staticmethod
    def make_autograd_function(name: str, forward: Any, backward: Any) -> Any:
        """A differentiable callable from ``forward(ctx, *args)`` / ``backward(ctx, *grads)``
        (MindSpore's custom-backward Function; DTensor arguments and results are supported)."""
        return ag.make_autograd_function(name, forward, backward)

    @staticmethod
    def no_grad() -> Any:
        return _no_grad()

    @staticmethod
    def forward_backward(fn: Any, inputs: Any) -> None:
        out, pullback = ms.vjp(fn, *inputs)
        pullback(ops.ones_like(out))

    @staticmethod
    def is_grad_enabled() -> bool:
        """True while MindSpore records a graph for differentiation (inside ms.grad /
        value_and_grad, outside no_grad)."""
        return bool(_pynative_executor.requires_grad())

    @staticmethod
    def loss_parallel_unsupported() -> str:
        # ops.cross_entropy is composed in Python of primitives (logsumexp, GatherD, masked_fill...),
        # so no single op reaches the vocab-parallel rule
        return ("MindSpore's ops.cross_entropy is composed of primitives that never reach the "
                "vocab-parallel rule. "
                "ops.cross_entropy on vocab-sharded DTensor logits outside the context is correct (its "
                "log-softmax stays sharded; the label pick takes the replicated fallback, which gathers "
                "the log-probs)")

    @staticmethod
    def detach(tensor: Any) -> Any:
        return tensor  # PyNative tensors hold no graph; ms.grad differentiates functions

    @staticmethod
    def requires_grad(tensor: Any) -> Any:
        # a MindSpore Tensor has no flag (ms.grad decides what is differentiated); a Parameter has one
        return getattr(tensor, "requires_grad", True)

    @staticmethod
    def is_floating_dtype(dtype: Any) -> bool:
        return dtype in (ms.float16, ms.float32, ms.float64, ms.bfloat16, ms.complex64, ms.complex128)

    @staticmethod
    def meta_tensor(shape: Any, dtype: Any) -> Any:
        return meta.MetaTensor(shape, dtype)

    @staticmethod
    def to_meta(tensor: Any) -> Any:
        return meta.MetaTensor(tuple(tensor.shape), tensor.dtype)

    # ---------------------------------------------------------------- tensor helpers for core
    @staticmethod
    def is_tensor(obj: Any) -> bool:
        return isinstance(obj, (ms.Tensor, meta.MetaTensor))

    @staticmethod
    def local_sum(tensor: Any, dim: Any = None, keepdim: bool = False) -> Any:
        """The sum of a local piece; MindSpore's CPU sum leaves an empty input's output
        uninitialised, so an empty piece gives zeros with a zero gradient (``op_names.local_sum``)."""
        from hyper_parallel.platform.mindspore.op_names import local_sum
        return local_sum(tensor, dim, keepdim)

    @staticmethod
    def tensor(data: Any, dtype: Any = None, device: Any = None) -> Any:
        array = np.asarray(data)
        if dtype is None and array.dtype == np.float64:
            array = array.astype(np.float32)
        return ms.Tensor(array, dtype=dtype)

    @staticmethod
    def arange(n: Any, device: Any = None) -> Any:
        return ops.arange(int(n), dtype=ms.int64)

    @staticmethod
    def cat(tensors: Any, dim: int = 0) -> Any:
        return mint.cat(list(tensors), dim)

    @staticmethod
    def zeros(shape: Any, dtype: Any = None, device: Any = None) -> Any:
        return mint.zeros(tuple(int(s) for s in shape), dtype=dtype or ms.float32)

    @staticmethod
    def empty(shape: Any, dtype: Any = None, device: Any = None) -> Any:
        return mint.zeros(tuple(int(s) for s in shape), dtype=dtype or ms.float32)

    @staticmethod
    def broadcast_shapes(*shapes: Any) -> Any:
        return tuple(np.broadcast_shapes(*[tuple(s) for s in shapes]))

    @staticmethod
    def bool_dtype() -> Any:
        return ms.bool_

    @staticmethod
    def float32() -> Any:
        return ms.float32

    @staticmethod
    def is_floating_point(tensor: Any) -> Any:
        return ms.dtype.is_floating_point(tensor.dtype) if hasattr(ms.dtype, "is_floating_point") \
            else tensor.dtype in (ms.float16, ms.float32, ms.float64, ms.bfloat16)

    @staticmethod
    def manual_seed(seed: Any) -> None:
        ms.set_seed(int(seed))

    # ---------------------------------------------------------------- modules and hooks
    # a Cell whose calls hyper_parallel routes is marked: compilers refuse it (compile_guard.py)
    def register_forward_pre_hook(self, module: Any, hook: Any, with_kwargs: bool = False) -> Any:
        compile_guard.mark(module)
        return module.register_forward_pre_hook(hook, with_kwargs=with_kwargs)

    def register_forward_hook(self, module: Any, hook: Any, with_kwargs: bool = False) -> Any:
        compile_guard.mark(module)
        return module.register_forward_hook(hook, with_kwargs=with_kwargs)

    @staticmethod
    def replace_forward(module: Any, make_wrapper: Any) -> Any:
        """Route ``module``'s calls through ``make_wrapper(original_construct)``; returns a function
        that restores the original. The replacement is a bound method, as ``construct`` is:
        ``ms.jit(cell)`` reads ``cell.construct.__func__`` (a plain function gave an AttributeError
        instead of the compile guard's error)."""
        original = module.construct
        wrapper = make_wrapper(original)
        compile_guard.mark(module)
        object.__setattr__(module, "construct", types.MethodType(
            lambda _self, *args, **kwargs: wrapper(*args, **kwargs), module))

        def restore():
            object.__delattr__(module, "construct")
        return restore

    @staticmethod
    def is_linear(module: Any) -> bool:
        classes = (ms.nn.Dense,) + ((mint.nn.Linear,) if hasattr(mint.nn, "Linear") else ())
        return isinstance(module, classes)

    @staticmethod
    def is_embedding(module: Any) -> bool:
        classes = (ms.nn.Embedding,) + ((mint.nn.Embedding,) if hasattr(mint.nn, "Embedding") else ())
        return isinstance(module, classes)

    @staticmethod
    def embedding_weight_name(module: Any) -> Any:
        return "embedding_table" if isinstance(module, ms.nn.Embedding) else "weight"

    @staticmethod
    def named_children(module: Any) -> Any:
        return list(module.name_cells().items())

    @staticmethod
    def named_modules(module: Any) -> Any:
        return list(module.cells_and_names())

    @staticmethod
    def named_parameters(module: Any, recurse: bool = False) -> Any:
        """The Cell's own parameters; a parallelized one as its DTensor view (set_parameter)."""
        if recurse:
            return list(module.parameters_and_names())
        from hyper_parallel.platform.mindspore.dtensor_base import MindSporeDTensorBase
        out = []
        for name, param in module._params.items():
            view = module.__dict__.get(name)
            out.append((name, view if isinstance(view, MindSporeDTensorBase) else param))
        return out

    @staticmethod
    def set_parameter(module: Any, name: str, value: Any) -> None:
        from hyper_parallel.platform.mindspore.dtensor_base import set_dtensor_parameter
        set_dtensor_parameter(module, name, value)

    # ---------------------------------------------------------------- attention kernels
    @staticmethod
    def sdpa(q: Any, k: Any, v: Any, attn_mask: Any = None, dropout_p: float = 0.0, is_causal: bool = False,
             scale: Any = None, enable_gqa: bool = False) -> Any:
        """Scaled dot-product attention on (..., heads, seq, dim) tensors; DTensors go to the sdpa rule,
        as F.scaled_dot_product_attention's do on torch."""
        return attention_kernels.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal, scale,
                                                              enable_gqa)

    @staticmethod
    def attention_block_forward(q: Any, k: Any, v: Any, causal: bool = False, scale: Any = None,
                                mask: Any = None, softcap: Any = None) -> Any:
        return attention_kernels.block_forward(q, k, v, causal, scale, mask, softcap)

    @staticmethod
    def attention_block_backward(grad_out: Any, q: Any, k: Any, v: Any, out: Any, lse: Any,
                                 causal: bool = False, scale: Any = None, mask: Any = None,
                                 softcap: Any = None) -> Any:
        return attention_kernels.block_backward(grad_out, q, k, v, out, lse, causal, scale, mask, softcap)


class _PeakMemory:
    """On devices, the allocator's peak; on CPU the growth of the process's peak RSS (a lower
    bound: CPU memory is not tracked per tensor)."""

    def __init__(self, platform):
        self._platform = platform
        self.peak_bytes = 0

    def __enter__(self):
        if self._platform.device_type != "cpu":
            ms.runtime.synchronize()
            self._base = ms.runtime.memory_allocated()
            ms.runtime.reset_peak_memory_stats()
        else:
            self._base = self._platform.peak_memory_bytes()
        return self

    def __exit__(self, *exc):
        if self._platform.device_type != "cpu":
            ms.runtime.synchronize()
            self.peak_bytes = int(ms.runtime.max_memory_allocated() - self._base)
        else:
            self.peak_bytes = max(0, self._platform.peak_memory_bytes() - self._base)
        return False


__all__ = ["MindSporePlatform", "MsGroup"]
