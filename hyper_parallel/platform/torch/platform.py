"""PyTorch platform: CPU (gloo) or CUDA (nccl)."""
from typing import Any, Dict, Optional
import datetime
import os
import resource

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hyper_parallel.platform.base import Platform
from hyper_parallel.platform.torch import attention_kernels
from hyper_parallel.platform.torch.autograd_apply import lean_apply
from hyper_parallel.platform.torch import factories as tensor_factories
from hyper_parallel.platform.torch import fully_shard_support
from hyper_parallel.platform.torch.collectives import Collectives
from hyper_parallel.platform.torch.compile_boundary import eager_boundary
from hyper_parallel.platform.torch.dtensor_base import TorchDTensorBase
from hyper_parallel.platform.torch.compute_state import TorchComputeState
from hyper_parallel.platform.torch.dispatch_hooks import TorchDispatchHooks
from hyper_parallel.platform.torch.linear_algebra import TorchLinearAlgebra
from hyper_parallel.platform.torch.long_sequence import TorchLongSequence
from hyper_parallel.platform.torch.memory import PeakMemory
from hyper_parallel.platform.torch.profiling import TorchProfiling


class TorchPlatform(TorchLinearAlgebra, TorchLongSequence, TorchComputeState, TorchDispatchHooks,
                    TorchProfiling, Platform):
    name = "torch"
    Tensor = torch.Tensor
    Module = torch.nn.Module
    Parameter = torch.nn.Parameter
    DTensorBase = TorchDTensorBase

    def __init__(self) -> None:
        super().__init__()
        self._comm = Collectives(self)
        self._groups: Dict[Any, Any] = {}
        self._group_ranks: Dict[Any, tuple] = {}
        self._group_timeouts: Dict[Any, Optional[float]] = {}
        self._companions: Dict[Any, Any] = {}   # group -> its agreement_group
        self._companion_keys: set = set()       # new_group keys whose companion exists
        self._default_timeout_s: Optional[float] = None

    # ---------------------------------------------------------------- device
    @property
    def device_type(self) -> Any:
        return "cuda" if torch.cuda.is_available() else "cpu"

    @property
    def default_backend(self) -> Any:
        return "nccl" if self.device_type == "cuda" else "gloo"

    def device(self) -> Any:
        if self.device_type == "cpu":
            return torch.device("cpu")
        return torch.device(self.device_type, self._device_module().current_device())

    def _device_module(self):
        return getattr(torch, self.device_type)

    def set_device(self, local_rank: Any) -> None:
        if self.device_type != "cpu":
            self._device_module().set_device(local_rank)

    def synchronize(self) -> None:
        if self.device_type != "cpu":
            self._device_module().synchronize()

    def track_peak_memory(self) -> Any:
        """Context manager measuring the peak bytes allocated inside it (``.peak_bytes``)."""
        return PeakMemory(self.device_type)

    def peak_memory_bytes(self) -> Any:
        """Peak device memory; on CPU the process's peak resident set (not resettable)."""
        if self.device_type != "cpu":
            return self._device_module().max_memory_allocated()
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    @staticmethod
    def compile_module(module: Any, **compile_kwargs: Any) -> Any:
        """torch.compile of a parallelized module, DTensor dispatch traced inside (compile_support.py)."""
        from hyper_parallel.platform.torch.compile_support import compile_module
        return compile_module(module, **compile_kwargs)

    def is_fake(self, tensor: Any) -> Any:
        """A FakeTensor (or a subclass wrapping one): shapes without values (hyper_parallel.plan)."""
        from torch._subclasses.fake_tensor import is_fake
        return is_fake(getattr(tensor, "_local_tensor", tensor))   # a DTensor: its local piece

    # ---------------------------------------------------------------- capabilities
    def capabilities(self) -> Any:
        backend = dist.get_backend() if dist.is_initialized() else self.default_backend
        table = {"all_gather": "native", "all_to_all_single": "native", "all_reduce": "native",
                 "broadcast": "native", "p2p (batch_isend_irecv)": "native",
                 "all_to_all (list)": "emulated: one uneven all_to_all_single of flat buffers",
                 "reduce_scatter": "native", "all_reduce avg": "native"}
        if backend == "gloo":
            table["all_gather"] = "emulated: all_to_all_single of n copies (same bytes, 2-3x faster on gloo)"
            table["reduce_scatter"] = "emulated: all_to_all_single + local reduction (same bytes)"
            table["all_reduce avg"] = "emulated: sum, then divide by the group size"
        return {"backend": backend, **table}

    # ---------------------------------------------------------------- process groups
    def init_process_group(self, backend: Any = None, timeout_s: Any = None, **kwargs: Any) -> None:
        if dist.is_initialized():
            return
        missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
        if missing and "init_method" not in kwargs:
            raise RuntimeError(f"cannot initialise the default process group: the launcher "
                               f"variables {missing} are not set (start with torchrun, or call "
                               f"torch.distributed.init_process_group yourself)")
        if self.device_type != "cpu":
            self.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        if timeout_s is not None:
            kwargs["timeout"] = datetime.timedelta(seconds=timeout_s)
        dist.init_process_group(backend or self.default_backend, **kwargs)
        self._default_timeout_s = timeout_s

    def is_initialized(self) -> Any:
        return dist.is_initialized()

    def get_rank(self, group: Any = None) -> Any:
        if group is None or group is dist.group.WORLD:
            return dist.get_rank()
        # the position in the ranks the group was created with (torch numbers them ascending);
        # -1 outside the group, as torch says
        ranks = self.group_ranks(group)
        me = dist.get_rank()
        return ranks.index(me) if me in ranks else -1

    def get_world_size(self, group: Any = None) -> Any:
        return dist.get_world_size(group)

    def new_group(self, ranks: Any, timeout_s: Any = None) -> Any:
        """The group of ``ranks``, cached per (ranks, timeout). ``timeout_s`` bounds its collectives;
        None (or the default group's own timeout) shares the default group's setting, and the whole
        world is then the default group itself."""
        ranks = tuple(int(r) for r in ranks)
        if timeout_s is not None and timeout_s == self._default_timeout_s:
            timeout_s = None
        key = ranks if timeout_s is None else (ranks, float(timeout_s))
        group = self._groups.get(key)
        if group is None:
            if ranks == tuple(range(dist.get_world_size())) and timeout_s is None:
                group = dist.group.WORLD
            else:
                kwargs: Dict[str, Any] = ({} if timeout_s is None
                                          else {"timeout": datetime.timedelta(seconds=timeout_s)})
                group = dist.new_group(list(ranks), use_local_synchronization=False, **kwargs)
            self._groups[key] = group
            self._group_ranks[group] = ranks
            self._group_timeouts[group] = timeout_s if timeout_s is not None else self._default_timeout_s
        # once per key, where every rank creates every group in one order; not per group object: a
        # rank outside several groups gets torch's one NON_GROUP_MEMBER for all of them, so only its first
        # got a companion, the ranks' new_group calls fell out of step and 2-D mesh checks timed out.
        # Only for a group with its own timeout (a mesh built with timeout=), where a lone rank's wait
        # is bounded: other meshes do not pay a second gloo group each (an 8-rank mesh test makes dozens)
        if timeout_s is not None and key not in self._companion_keys:
            self._companion_keys.add(key)
            self._companions[group] = self._companion(ranks, timeout_s)
        return group

    def _companion(self, ranks, timeout_s):
        kwargs: Dict[str, Any] = {"timeout": datetime.timedelta(seconds=timeout_s)}
        companion = dist.new_group(list(ranks), use_local_synchronization=False, **kwargs)
        self._group_ranks[companion] = ranks
        self._group_timeouts[companion] = timeout_s
        return companion

    def agreement_group(self, group: Any) -> Any:
        """The companion of a group ``new_group`` made with a timeout (core/agreement.py's checks run
        there: a rank checking alone then waits out the timeout instead of meeting a data
        collective); the group itself otherwise."""
        return self._companions.get(dist.group.WORLD if group is None else group, group)

    def group_timeout(self, group: Any) -> Any:
        """The collective timeout of ``group`` in seconds, or None for the framework's default."""
        if group is None or group is dist.group.WORLD:
            return self._default_timeout_s
        return self._group_timeouts.get(group)

    def group_ranks(self, group: Any) -> Any:
        if group is None or group is dist.group.WORLD:
            return tuple(range(dist.get_world_size()))
        ranks = self._group_ranks.get(group)
        if ranks is not None:
            return ranks
        try:
            return tuple(dist.get_process_group_ranks(group))
        except KeyError:  # torch's own message is the bare group object
            raise RuntimeError(f"process group {group!r} is gone (destroy_process_group() was called after "
                               f"it was created); meshes and DTensors do not outlive their process group: "
                               f"build a new mesh (init_device_mesh) and new DTensors after initialising "
                               f"again") from None

    def barrier(self, group: Any = None) -> None:
        self._comm._launch("barrier", group, lambda: dist.barrier(group))

    def destroy_process_group(self) -> None:
        if dist.is_initialized():
            dist.barrier()  # without it a gloo rank sometimes aborts at exit
            dist.destroy_process_group()
        self._groups.clear()
        self._group_ranks.clear()
        self._group_timeouts.clear()
        self._companions.clear()
        self._companion_keys.clear()

    # ---------------------------------------------------------------- autograd plumbing for core
    @staticmethod
    def make_autograd_function(name: str, forward: Any, backward: Any) -> Any:
        """A differentiable callable from ``forward(ctx, *args)`` / ``backward(ctx, *grads)``."""
        fn = type(name, (torch.autograd.Function,),
                  {"forward": staticmethod(forward), "backward": staticmethod(backward)})
        return lean_apply(fn)

    @staticmethod
    def no_grad() -> Any:
        return torch.no_grad()

    @staticmethod
    def is_grad_enabled() -> Any:
        return torch.is_grad_enabled()

    @staticmethod
    def forward_backward(fn: Any, inputs: Any) -> None:
        with torch.enable_grad():
            out = fn(*(t.detach().requires_grad_() for t in inputs))
            out.backward(torch.ones_like(out))

    @staticmethod
    def requires_grad(tensor: Any) -> Any:
        return tensor.requires_grad

    @staticmethod
    def is_floating_dtype(dtype: Any) -> Any:
        return dtype.is_floating_point or dtype.is_complex

    @staticmethod
    def meta_tensor(shape: Any, dtype: Any) -> Any:
        return torch.empty(shape, dtype=dtype, device="meta")

    @staticmethod
    def to_meta(tensor: Any) -> Any:
        return tensor.to("meta")

    # ---------------------------------------------------------------- tensor helpers for core
    @staticmethod
    def is_tensor(obj: Any) -> bool:
        return isinstance(obj, torch.Tensor)

    @staticmethod
    def local_sum(tensor: Any, dim: Any = None, keepdim: bool = False) -> Any:
        return tensor.sum(dim=dim, keepdim=keepdim)

    @staticmethod
    def tensor(data: Any, dtype: Any = None, device: Any = None) -> Any:
        return torch.tensor(data, dtype=dtype, device=device)

    @staticmethod
    def arange(n: Any, device: Any = None) -> Any:
        return torch.arange(n, device=device)

    @staticmethod
    def cat(tensors: Any, dim: int = 0) -> Any:
        return torch.cat(tensors, dim)

    @staticmethod
    def zeros(shape: Any, dtype: Any = None, device: Any = None) -> Any:
        return torch.zeros(shape, dtype=dtype, device=device)

    @staticmethod
    def empty(shape: Any, dtype: Any = None, device: Any = None) -> Any:
        return torch.empty(shape, dtype=dtype, device=device)

    @staticmethod
    def broadcast_shapes(*shapes: Any) -> Any:
        return tuple(torch.broadcast_shapes(*shapes))

    @staticmethod
    def bool_dtype() -> Any:
        return torch.bool

    @staticmethod
    def float32() -> Any:
        return torch.float32

    @staticmethod
    def is_floating_point(tensor: Any) -> Any:
        return tensor.is_floating_point()

    @staticmethod
    def manual_seed(seed: Any) -> None:
        torch.manual_seed(seed)

    # ---------------------------------------------------------------- modules and hooks
    # the library's hooks and forward wrappers run eagerly under torch.compile (a graph boundary,
    # docs/compile.md): dynamo cannot trace core's DTensor conversions
    def register_forward_pre_hook(self, module: Any, hook: Any, with_kwargs: bool = False) -> Any:
        return module.register_forward_pre_hook(eager_boundary(hook), with_kwargs=with_kwargs)

    def register_forward_hook(self, module: Any, hook: Any, with_kwargs: bool = False) -> Any:
        return module.register_forward_hook(eager_boundary(hook), with_kwargs=with_kwargs)

    @staticmethod
    def replace_forward(module: Any, make_wrapper: Any) -> Any:
        """Route ``module``'s calls through ``make_wrapper(original_forward)``; returns a function
        that restores the original."""
        original = module.forward
        module.forward = eager_boundary(make_wrapper(original))

        def restore():
            module.forward = original
        return restore

    @staticmethod
    def register_grad_ready_hooks(params: Any, on_ready: Any, on_backward_end: Any) -> Any:
        """Per-parameter post-accumulate-grad hooks (fired as backward reaches each parameter, so
        communication overlaps the rest of backward) plus one engine callback per backward."""
        last_task = [None]

        def hook(param):
            # keyed by the engine's graph task, so a backward that raised cannot block the next one
            task = torch._C._current_graph_task_id()
            if task != last_task[0]:
                last_task[0] = task
                torch.autograd.Variable._execution_engine.queue_callback(on_backward_end)
            on_ready(param)
        handles = [p.register_post_accumulate_grad_hook(hook) for p in params]

        def remove():
            for handle in handles:
                handle.remove()
        return remove

    @staticmethod
    def is_linear(module: Any) -> bool:
        return isinstance(module, torch.nn.Linear)

    @staticmethod
    def is_embedding(module: Any) -> bool:
        return isinstance(module, torch.nn.Embedding)

    @staticmethod
    def named_parameters(module: Any, recurse: bool = False) -> Any:
        return module.named_parameters(recurse=recurse)

    @staticmethod
    def set_parameter(module: Any, name: str, value: Any) -> None:
        module.register_parameter(name, torch.nn.Parameter(value, requires_grad=value.requires_grad))

    named_buffers, set_buffer, create_tensor = tensor_factories.PLATFORM_METHODS  # DTensor factories
    (free_storage, alloc_storage, untracked, swap_parameter, register_multi_grad_hook, is_autograd_leaf,
     queue_backward_callback) = fully_shard_support.PLATFORM_METHODS  # fully_shard
    register_optimizer_step_pre_hook, register_grad_arrival_hook = fully_shard_support.STATE_METHODS

    @staticmethod
    def dense(tensor: Any) -> Any:
        if tensor.is_contiguous():
            return tensor
        # a permutation of a contiguous layout: sorted by stride, each stride is the product of the
        # sizes below it (size-1 dims place nothing)
        expected = 1
        for stride, size in sorted((st, sz) for st, sz in zip(tensor.stride(), tensor.shape) if sz > 1):
            if stride != expected:
                return tensor.contiguous()
            expected *= size
        return tensor

    # ---------------------------------------------------------------- attention kernels
    @staticmethod
    def sdpa(q: Any, k: Any, v: Any, attn_mask: Any = None, dropout_p: float = 0.0, is_causal: bool = False,
             scale: Any = None, enable_gqa: bool = False) -> Any:
        """Scaled dot-product attention on (..., heads, seq, dim) tensors."""
        kwargs = {"enable_gqa": True} if enable_gqa else {}
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p,
                                              is_causal=is_causal, scale=scale, **kwargs)

    @staticmethod
    def attention_block_forward(q: Any, k: Any, v: Any, causal: bool = False, scale: Any = None,
                                mask: Any = None, softcap: Any = None) -> Any:
        """(out, float32 log-sum-exp) of attention over one key block (batch, heads, seq, dim);
        ``mask``: optional boolean, True where attention is allowed."""
        return attention_kernels.block_forward(q, k, v, causal, scale, mask, softcap)

    @staticmethod
    def attention_block_backward(grad_out: Any, q: Any, k: Any, v: Any, out: Any, lse: Any,
                                 causal: bool = False, scale: Any = None, mask: Any = None,
                                 softcap: Any = None) -> Any:
        """(dq, dk, dv) of one key block, given the final output and log-sum-exp of the row."""
        return attention_kernels.block_backward(grad_out, q, k, v, out, lse, causal, scale, mask, softcap)
