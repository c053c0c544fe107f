"""The complete contract between core and a framework: every member core uses, by concern.

``core/`` and ``integrations/`` call ``get_platform()`` where they use a member; the contract test
(``tests/test_platform_contract.py``) fails on an undeclared one. ``@abstractmethod`` members are
what a framework provides; the others default to what is the same everywhere (the collective
forwarders, the differentiable collectives) or to a framework lacking the concept (aten, buffers).
"""
import abc
import threading
from typing import Any, Dict, Optional
from hyper_parallel.platform.handles import AsyncHandle, CompletedHandle  # noqa: F401  (re-exported)
from hyper_parallel.platform.training_contract import TrainingLoopContract, unavailable as _unavailable
from hyper_parallel.platform.split_collectives import SplitCollectivesContract
from hyper_parallel.platform.compute_state_contract import ComputeStateContract
from hyper_parallel.platform.linear_algebra_contract import LinearAlgebraContract
from hyper_parallel.platform.long_sequence_contract import LongSequenceContract as _LongSequence
from hyper_parallel.platform.dispatch_hooks_contract import DispatchHooksContract
from hyper_parallel.platform.observability_contract import ObservabilityContract
REDUCE_OPS = ("sum", "avg", "max", "min")


class Platform(TrainingLoopContract, SplitCollectivesContract, LinearAlgebraContract, _LongSequence,
               ComputeStateContract, DispatchHooksContract, ObservabilityContract, abc.ABC):
    """Abstract platform. A subclass sets ``_comm`` (its raw collectives) in ``__init__``. Declared in their
    own files (*_contract.py): the training loop, split collectives, the delta rule's linear algebra,
    the dispatchers' op hooks, communication accounting and profiler ranges."""

    name = "abstract"
    # ---------------------------------------------------------------- framework classes
    Tensor: Any = None        # the framework's tensor class
    Module: Any = None        # its module class (torch.nn.Module, mindspore.nn.Cell)
    Parameter: Any = None     # its parameter class
    DTensorBase: Any = None   # the base core's DTensor subclasses (see the platform's dtensor_base.py)

    def __init__(self) -> None:
        self._comm: Any = None
        self._autograd_comm: Any = None
        self._comm_observers = []
        self._observer_lock = threading.Lock()

    @abc.abstractmethod
    def capabilities(self) -> Dict[str, str]:
        """``{collective: "native" | "emulated: how"}`` for the current backend, plus "backend"."""

    # ---------------------------------------------------------------- process groups
    @abc.abstractmethod
    def init_process_group(self, backend: Optional[str] = None, timeout_s: Optional[float] = None,
                           **kwargs: Any) -> None:
        """Initialise the default group from the launcher's environment (no-op if done)."""

    @abc.abstractmethod
    def is_initialized(self) -> bool:
        """Whether the default group exists."""

    @abc.abstractmethod
    def get_rank(self, group: Any = None) -> int:
        """This process's rank in ``group`` (default: the world)."""

    @abc.abstractmethod
    def get_world_size(self, group: Any = None) -> int:
        """The number of ranks in ``group`` (default: the world)."""

    @abc.abstractmethod
    def new_group(self, ranks: Any, timeout_s: Optional[float] = None) -> Any:
        """The group of ``ranks`` (global ranks, in mesh order), created once and cached; every rank
        calls it for every group in the same order (DeviceMesh guarantees that)."""

    @abc.abstractmethod
    def group_ranks(self, group: Any) -> Any:
        """The global ranks of ``group`` in creation order."""

    def group_timeout(self, group: Any) -> Optional[float]:
        """The collective timeout of ``group`` in seconds, or None for the framework's default."""
        return None

    def agreement_group(self, group: Any) -> Any:
        """The group core/agreement.py exchanges its settings checks on for ``group``'s ranks: a
        companion created beside ``group`` where the framework can, so a rank entering a check
        alone waits there (bounded by the timeout) instead of meeting its peers' next data
        collective; ``group`` itself where it cannot."""
        return group

    @abc.abstractmethod
    def barrier(self, group: Any = None) -> None:
        """Wait for every rank of ``group``."""

    @abc.abstractmethod
    def destroy_process_group(self) -> None:
        """Tear the groups down (a barrier first)."""

    # ---------------------------------------------------------------- raw collectives
    # Each returns the result, or an AsyncHandle when async_op=True. Inputs may be non-contiguous;
    # outputs are new contiguous tensors. ``self._comm`` implements them per framework.
    def all_gather(self, tensor: Any, group: Any, dim: int = 0, async_op: bool = False) -> Any:
        """Every rank's ``tensor`` concatenated along ``dim`` in group-rank order."""
        with self.profile_range("hyper_parallel::all_gather"):
            return self._comm.all_gather(tensor, group, dim, async_op)

    def all_to_all_single(self, tensor: Any, group: Any, split_dim: int = 0, concat_dim: int = 0,
                          async_op: bool = False) -> Any:
        """Block i of ``split_dim`` goes to group rank i; received blocks concatenate on ``concat_dim``."""
        with self.profile_range("hyper_parallel::all_to_all_single"):
            return self._comm.all_to_all_single(tensor, group, split_dim, concat_dim, async_op)

    def all_to_all(self, tensors: Any, group: Any, out_shapes: Any = None, async_op: bool = False) -> Any:
        """``tensors[i]`` goes to group rank i; the piece from rank j comes back as ``out_shapes[j]``."""
        with self.profile_range("hyper_parallel::all_to_all"):
            return self._comm.all_to_all(tensors, group, out_shapes, async_op)

    def reduce_scatter(self, tensor: Any, group: Any, dim: int = 0, op: str = "sum",
                       async_op: bool = False) -> Any:
        """The reduction over the group, this rank keeping its block of ``dim``."""
        with self.profile_range("hyper_parallel::reduce_scatter"):
            return self._comm.reduce_scatter(tensor, group, dim, op, async_op)

    def all_reduce(self, tensor: Any, group: Any, op: str = "sum", async_op: bool = False,
                   tag: Any = None) -> Any:
        """The reduction over the group; ``tag`` names the call in accounting (default all_reduce)."""
        with self.profile_range("hyper_parallel::all_reduce"):
            return self._comm.all_reduce(tensor, group, op, async_op, tag)

    def broadcast(self, tensor: Any, src: Any, group: Any, async_op: bool = False) -> Any:
        """``src``'s tensor (``src`` a global rank) on every rank."""
        with self.profile_range("hyper_parallel::broadcast"):
            return self._comm.broadcast(tensor, src, group, async_op)

    def p2p_exchange(self, sends: Any, recvs: Any, group: Any = None, async_op: bool = False) -> Any:
        """Batched point-to-point: ``sends`` = [(tensor, global_dst)], ``recvs`` =
        [(template_tensor, global_src)] whose shape/dtype the received tensors take."""
        with self.profile_range("hyper_parallel::p2p_exchange"):
            return self._comm.p2p_exchange(sends, recvs, group, async_op)

    # ---------------------------------------------------------------- differentiable collectives
    # Written once (differentiable_collectives.py) on make_autograd_function and the raw ones.
    def _differentiable(self):
        if self._autograd_comm is None:
            from hyper_parallel.platform.differentiable_collectives import DifferentiableCollectives
            self._autograd_comm = DifferentiableCollectives(self)
        return self._autograd_comm

    def differentiable_all_gather(self, tensor: Any, group: Any, dim: int = 0) -> Any:
        """all_gather whose backward is a reduce-scatter of the gradient."""
        return self._differentiable().all_gather(tensor, group, dim)

    def differentiable_reduce_scatter(self, tensor: Any, group: Any, dim: int = 0) -> Any:
        """reduce_scatter (sum) whose backward is an all-gather of the gradient."""
        return self._differentiable().reduce_scatter(tensor, group, dim)

    def differentiable_all_to_all(self, tensor: Any, group: Any, split_dim: Any, concat_dim: Any) -> Any:
        """all_to_all_single whose backward is the inverse all-to-all."""
        return self._differentiable().all_to_all(tensor, group, split_dim, concat_dim)

    def differentiable_all_reduce(self, tensor: Any, group: Any, op: str = "sum",
                                  backward: str = "sum") -> Any:
        """all_reduce; ``backward="sum"`` all-reduces the gradient, ``"identity"`` passes it on."""
        return self._differentiable().all_reduce(tensor, group, op, backward)

    def differentiable_p2p_exchange(self, tensor: Any, send_to: Any, recv_from: Any,
                                    group: Any = None) -> Any:
        """Send to ``send_to``, receive a same-shaped tensor from ``recv_from``; backward reverses it."""
        return self._differentiable().p2p_exchange(tensor, send_to, recv_from, group)

    # ---------------------------------------------------------------- device and memory
    @property
    @abc.abstractmethod
    def device_type(self) -> str:
        """"cpu", "cuda", "npu", "ascend"..."""

    @property
    @abc.abstractmethod
    def default_backend(self) -> str:
        """The communication backend init_process_group uses by default."""

    @abc.abstractmethod
    def device(self) -> Any:
        """The current device object."""

    @abc.abstractmethod
    def set_device(self, local_rank: Any) -> Any:
        """Bind this process to device ``local_rank`` (no-op on CPU)."""

    @abc.abstractmethod
    def synchronize(self) -> Any:
        """Wait for the queued device work."""

    @abc.abstractmethod
    def track_peak_memory(self) -> Any:
        """Context manager measuring the peak bytes allocated inside it (``.peak_bytes``)."""

    @abc.abstractmethod
    def peak_memory_bytes(self) -> int:
        """Peak device memory; on CPU the process's peak resident set."""

    @abc.abstractmethod
    def manual_seed(self, seed: Any) -> Any:
        """Seed the framework's random generator."""

    # ---------------------------------------------------------------- tensor factories
    @abc.abstractmethod
    def tensor(self, data: Any, dtype: Any = None, device: Any = None) -> Any:
        """A tensor from Python data."""

    @abc.abstractmethod
    def arange(self, n: Any, device: Any = None) -> Any:
        """0 .. n-1 as int64."""

    @abc.abstractmethod
    def zeros(self, shape: Any, dtype: Any = None, device: Any = None) -> Any:
        """Zeros of ``shape``."""

    @abc.abstractmethod
    def empty(self, shape: Any, dtype: Any = None, device: Any = None) -> Any:
        """An uninitialised (or zero) tensor of ``shape``."""

    @staticmethod
    def zeros_like(tensor: Any) -> Any:
        """Zeros with ``tensor``'s shape, dtype and device."""
        return tensor.new_zeros(tensor.shape)

    @abc.abstractmethod
    def cat(self, tensors: Any, dim: int = 0) -> Any:
        """Concatenation along ``dim``."""

    @abc.abstractmethod
    def meta_tensor(self, shape: Any, dtype: Any) -> Any:
        """A data-less tensor of ``shape`` (shape inference)."""

    @abc.abstractmethod
    def to_meta(self, tensor: Any) -> Any:
        """``tensor``'s shape and dtype as a meta tensor."""

    def create_tensor(self, kind: Any, shape: Any, dtype: Any = None, device: Any = None,
                      fill_value: Any = None) -> Any:
        """The factory ``kind`` (zeros / ones / empty / full / rand / randn) on ``shape``."""
        raise _unavailable(f"hyper_parallel's DTensor factories ({kind})", self)

    # ---------------------------------------------------------------- shapes and dtypes
    @abc.abstractmethod
    def is_tensor(self, obj: Any) -> bool:
        """Whether ``obj`` is a framework tensor (a DTensor included)."""

    @abc.abstractmethod
    def broadcast_shapes(self, *shapes: Any) -> Any:
        """The broadcast of ``shapes`` as a tuple."""

    @abc.abstractmethod
    def is_floating_dtype(self, dtype: Any) -> bool:
        """Floating or complex ``dtype`` (one that carries gradients)."""

    @abc.abstractmethod
    def is_floating_point(self, tensor: Any) -> bool:
        """Whether ``tensor`` has a floating dtype."""

    @abc.abstractmethod
    def bool_dtype(self) -> Any:
        """The framework's bool dtype."""

    @abc.abstractmethod
    def float32(self) -> Any:
        """The framework's float32 dtype."""

    @staticmethod
    def detach(tensor: Any) -> Any:
        """``tensor`` cut from the autograd graph, sharing its data (no graph: itself)."""
        return tensor.detach()

    @abc.abstractmethod
    def local_sum(self, tensor: Any, dim: Any = None, keepdim: bool = False) -> Any:
        """``tensor.sum(dim, keepdim)`` of a local piece; an empty piece gives zeros (zero gradient)."""

    # ---------------------------------------------------------------- autograd plumbing
    @abc.abstractmethod
    def make_autograd_function(self, name: str, forward: Any, backward: Any) -> Any:
        """A differentiable callable from ``forward(ctx, *args)`` / ``backward(ctx, *grads)``
        (one gradient per argument, None for non-tensors); DTensor arguments and results work."""

    @abc.abstractmethod
    def no_grad(self) -> Any:
        """Context manager: record no graph inside."""

    @abc.abstractmethod
    def is_grad_enabled(self) -> bool:
        """Whether operations are recorded for differentiation now."""

    @abc.abstractmethod
    def requires_grad(self, tensor: Any) -> bool:
        """Whether ``tensor`` may need a gradient (a framework that decides later: True)."""

    # ---------------------------------------------------------------- module surgery
    @abc.abstractmethod
    def register_forward_pre_hook(self, module: Any, hook: Any, with_kwargs: bool = False) -> Any:
        """``hook(module, args[, kwargs])`` before every forward; returns a removable handle."""

    @abc.abstractmethod
    def register_forward_hook(self, module: Any, hook: Any, with_kwargs: bool = False) -> Any:
        """``hook(module, args, [kwargs,] output)`` after every forward; returns a removable handle."""

    def register_grad_ready_hooks(self, params: Any, on_ready: Any, on_backward_end: Any) -> Any:
        """``on_ready(param)`` once ``param.grad`` holds this backward's gradient, ``on_backward_end()``
        once at the end of each backward that readied one of ``params``; returns a remover."""
        raise _unavailable("register_grad_ready_hooks (gradient-ready hooks)", self)

    @abc.abstractmethod
    def replace_forward(self, module: Any, make_wrapper: Any) -> Any:
        """Route calls through ``make_wrapper(original_forward)``; returns a restoring function."""

    @abc.abstractmethod
    def is_linear(self, module: Any) -> bool:
        """Whether ``module`` is the framework's linear layer."""

    @abc.abstractmethod
    def is_embedding(self, module: Any) -> bool:
        """Whether ``module`` is the framework's embedding layer."""

    @staticmethod
    def embedding_weight_name(module: Any) -> str:
        """The name of an embedding module's table parameter (torch: ``weight``)."""
        return "weight"

    @staticmethod
    def named_children(module: Any) -> Any:
        """(name, child module) pairs (torch's spelling; MindSpore's Cell differs)."""
        return module.named_children()

    @staticmethod
    def named_modules(module: Any) -> Any:
        """(dotted name, module) pairs, the module itself first as ""."""
        return module.named_modules()

    @abc.abstractmethod
    def named_parameters(self, module: Any, recurse: bool = False) -> Any:
        """(name, parameter) pairs; a parallelized one as its DTensor."""

    @abc.abstractmethod
    def set_parameter(self, module: Any, name: str, value: Any) -> Any:
        """Make ``module.<name>`` the DTensor ``value`` (a parameter of the framework's optimizers)."""

    @staticmethod
    def named_buffers(module: Any, recurse: bool = False) -> Any:
        """(name, buffer) pairs of ``module`` (frameworks without buffers: none)."""
        return []

    def set_buffer(self, module: Any, name: str, value: Any) -> Any:
        """Replace buffer ``name`` of ``module`` by ``value``."""
        raise _unavailable("set_buffer (module buffers)", self)

    # ---------------------------------------------------------------- attention kernels
    @abc.abstractmethod
    def sdpa(self, q: Any, k: Any, v: Any, attn_mask: Any = None, dropout_p: float = 0.0,
             is_causal: bool = False, scale: Any = None, enable_gqa: bool = False) -> Any:
        """Scaled dot-product attention on (..., heads, seq, dim) tensors."""

    @abc.abstractmethod
    def attention_block_forward(self, q: Any, k: Any, v: Any, causal: bool = False, scale: Any = None,
                                mask: Any = None, softcap: Any = None) -> Any:
        """(out, fp32 log-sum-exp) over a key block (b, h, s, d); mask: bool; softcap c: s -> c·tanh(s/c)."""

    @abc.abstractmethod
    def attention_block_backward(self, grad_out: Any, q: Any, k: Any, v: Any, out: Any, lse: Any,
                                 causal: bool = False, scale: Any = None, mask: Any = None,
                                 softcap: Any = None) -> Any:
        """(dq, dk, dv) of one key block, given the final output and log-sum-exp of the row."""
