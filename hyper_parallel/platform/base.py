"""The complete contract between core and a framework: every member core uses, by concern.

``core/`` and ``integrations/`` call ``get_platform()`` where they use a member; the contract test
(``tests/test_platform_contract.py``) fails on an undeclared one. ``@abstractmethod`` members are
what a framework provides; the others default to what is the same everywhere (the collective
forwarders, the differentiable collectives) or to a framework lacking the concept (aten, buffers).
"""
import abc
import threading
from typing import Any, Callable, Dict, Optional
from hyper_parallel.platform.handles import AsyncHandle, CompletedHandle  # noqa: F401  (re-exported)
from hyper_parallel.platform.training_contract import TrainingLoopContract, unavailable as _unavailable
from hyper_parallel.platform.split_collectives import SplitCollectivesContract
from hyper_parallel.platform.compute_state_contract import ComputeStateContract
from hyper_parallel.platform.linear_algebra_contract import LinearAlgebraContract
from hyper_parallel.platform.long_sequence_contract import LongSequenceContract as _LongSequence
REDUCE_OPS = ("sum", "avg", "max", "min")


class Platform(TrainingLoopContract, SplitCollectivesContract, LinearAlgebraContract, _LongSequence,
               ComputeStateContract, abc.ABC):
    """Abstract platform. A subclass sets ``_comm`` (its raw collectives) in ``__init__``. Declared in their
    own files: the training loop, split collectives, the delta rule's linear algebra (*_contract.py)."""

    name = "abstract"
    # ---------------------------------------------------------------- framework classes
    Tensor = None        # the framework's tensor class
    Module = None        # its module class (torch.nn.Module, mindspore.nn.Cell)
    Parameter = None     # its parameter class
    DTensorBase = None   # the base core's DTensor subclasses (see the platform's dtensor_base.py)

    def __init__(self):
        self._comm = None
        self._autograd_comm = None
        self._comm_observers = []
        self._observer_lock = threading.Lock()

    # ---------------------------------------------------------------- communication accounting
    def add_comm_observer(self, observer: Callable[[str, int, tuple], None]) -> None:
        """``observer(op_name, bytes_sent, group_ranks)`` is called for every collective."""
        with self._observer_lock:
            self._comm_observers.append(observer)

    def remove_comm_observer(self, observer: Callable[[str, int, tuple], None]) -> None:
        """Stop calling ``observer``."""
        with self._observer_lock:
            self._comm_observers.remove(observer)

    def record_comm(self, op_name: str, bytes_sent: int, group_ranks: tuple) -> None:
        """Report one collective to the observers (the collectives call this)."""
        for observer in list(self._comm_observers):
            observer(op_name, bytes_sent, group_ranks)

    @abc.abstractmethod
    def capabilities(self) -> Dict[str, str]:
        """``{collective: "native" | "emulated: how"}`` for the current backend, plus "backend"."""

    # ---------------------------------------------------------------- process groups
    @abc.abstractmethod
    def init_process_group(self, backend: Optional[str] = None, timeout_s: Optional[float] = None,
                           **kwargs: Any) -> None:
        """Initialise the default group from the launcher's environment (no-op if done)."""

    @abc.abstractmethod
    def is_initialized(self):
        """Whether the default group exists."""

    @abc.abstractmethod
    def get_rank(self, group=None):
        """This process's rank in ``group`` (default: the world)."""

    @abc.abstractmethod
    def get_world_size(self, group=None):
        """The number of ranks in ``group`` (default: the world)."""

    @abc.abstractmethod
    def new_group(self, ranks, timeout_s=None):
        """The group of ``ranks`` (global ranks, in mesh order), created once and cached; every rank
        calls it for every group in the same order (DeviceMesh guarantees that)."""

    @abc.abstractmethod
    def group_ranks(self, group):
        """The global ranks of ``group`` in creation order."""

    def group_timeout(self, group):
        """The collective timeout of ``group`` in seconds, or None for the framework's default."""
        return None

    def agreement_group(self, group):
        """The group core/agreement.py exchanges its settings checks on for ``group``'s ranks: a
        companion created beside ``group`` where the framework can, so a rank entering a check
        alone waits there (bounded by the timeout) instead of meeting its peers' next data
        collective; ``group`` itself where it cannot."""
        return group

    @abc.abstractmethod
    def barrier(self, group=None):
        """Wait for every rank of ``group``."""

    @abc.abstractmethod
    def destroy_process_group(self):
        """Tear the groups down (a barrier first)."""

    # ---------------------------------------------------------------- raw collectives
    # Each returns the result, or an AsyncHandle when async_op=True. Inputs may be non-contiguous;
    # outputs are new contiguous tensors. ``self._comm`` implements them per framework.
    def all_gather(self, tensor, group, dim=0, async_op=False):
        """Every rank's ``tensor`` concatenated along ``dim`` in group-rank order."""
        return self._comm.all_gather(tensor, group, dim, async_op)

    def all_to_all_single(self, tensor, group, split_dim=0, concat_dim=0, async_op=False):
        """Block i of ``split_dim`` goes to group rank i; received blocks concatenate on ``concat_dim``."""
        return self._comm.all_to_all_single(tensor, group, split_dim, concat_dim, async_op)

    def all_to_all(self, tensors, group, out_shapes=None, async_op=False):
        """``tensors[i]`` goes to group rank i; the piece from rank j comes back as ``out_shapes[j]``."""
        return self._comm.all_to_all(tensors, group, out_shapes, async_op)

    def reduce_scatter(self, tensor, group, dim=0, op="sum", async_op=False):
        """The reduction over the group, this rank keeping its block of ``dim``."""
        return self._comm.reduce_scatter(tensor, group, dim, op, async_op)

    def all_reduce(self, tensor, group, op="sum", async_op=False, tag=None):
        """The reduction over the group; ``tag`` names the call in accounting (default all_reduce)."""
        return self._comm.all_reduce(tensor, group, op, async_op, tag)

    def broadcast(self, tensor, src, group, async_op=False):
        """``src``'s tensor (``src`` a global rank) on every rank."""
        return self._comm.broadcast(tensor, src, group, async_op)

    def p2p_exchange(self, sends, recvs, group=None, async_op=False):
        """Batched point-to-point: ``sends`` = [(tensor, global_dst)], ``recvs`` =
        [(template_tensor, global_src)] whose shape/dtype the received tensors take."""
        return self._comm.p2p_exchange(sends, recvs, group, async_op)

    # ---------------------------------------------------------------- differentiable collectives
    # Written once (differentiable_collectives.py) on make_autograd_function and the raw ones.
    def _differentiable(self):
        if self._autograd_comm is None:
            from hyper_parallel.platform.differentiable_collectives import DifferentiableCollectives
            self._autograd_comm = DifferentiableCollectives(self)
        return self._autograd_comm

    def differentiable_all_gather(self, tensor, group, dim=0):
        """all_gather whose backward is a reduce-scatter of the gradient."""
        return self._differentiable().all_gather(tensor, group, dim)

    def differentiable_reduce_scatter(self, tensor, group, dim=0):
        """reduce_scatter (sum) whose backward is an all-gather of the gradient."""
        return self._differentiable().reduce_scatter(tensor, group, dim)

    def differentiable_all_to_all(self, tensor, group, split_dim, concat_dim):
        """all_to_all_single whose backward is the inverse all-to-all."""
        return self._differentiable().all_to_all(tensor, group, split_dim, concat_dim)

    def differentiable_all_reduce(self, tensor, group, op="sum", backward="sum"):
        """all_reduce; ``backward="sum"`` all-reduces the gradient, ``"identity"`` passes it on."""
        return self._differentiable().all_reduce(tensor, group, op, backward)

    def differentiable_p2p_exchange(self, tensor, send_to, recv_from, group=None):
        """Send to ``send_to``, receive a same-shaped tensor from ``recv_from``; backward reverses it."""
        return self._differentiable().p2p_exchange(tensor, send_to, recv_from, group)

    # ---------------------------------------------------------------- device and memory
    @property
    @abc.abstractmethod
    def device_type(self):
        """"cpu", "cuda", "npu", "ascend"..."""

    @property
    @abc.abstractmethod
    def default_backend(self):
        """The communication backend init_process_group uses by default."""

    @abc.abstractmethod
    def device(self):
        """The current device object."""

    @abc.abstractmethod
    def set_device(self, local_rank):
        """Bind this process to device ``local_rank`` (no-op on CPU)."""

    @abc.abstractmethod
    def synchronize(self):
        """Wait for the queued device work."""

    @abc.abstractmethod
    def track_peak_memory(self):
        """Context manager measuring the peak bytes allocated inside it (``.peak_bytes``)."""

    @abc.abstractmethod
    def peak_memory_bytes(self):
        """Peak device memory; on CPU the process's peak resident set."""

    @abc.abstractmethod
    def manual_seed(self, seed):
        """Seed the framework's random generator."""

    # ---------------------------------------------------------------- tensor factories
    @abc.abstractmethod
    def tensor(self, data, dtype=None, device=None):
        """A tensor from Python data."""

    @abc.abstractmethod
    def arange(self, n, device=None):
        """0 .. n-1 as int64."""

    @abc.abstractmethod
    def zeros(self, shape, dtype=None, device=None):
        """Zeros of ``shape``."""

    @abc.abstractmethod
    def empty(self, shape, dtype=None, device=None):
        """An uninitialised (or zero) tensor of ``shape``."""

    @staticmethod
    def zeros_like(tensor):
        """Zeros with ``tensor``'s shape, dtype and device."""
        return tensor.new_zeros(tensor.shape)

    @abc.abstractmethod
    def cat(self, tensors, dim=0):
        """Concatenation along ``dim``."""

    @abc.abstractmethod
    def meta_tensor(self, shape, dtype):
        """A data-less tensor of ``shape`` (shape inference)."""

    @abc.abstractmethod
    def to_meta(self, tensor):
        """``tensor``'s shape and dtype as a meta tensor."""

    def create_tensor(self, kind, shape, dtype=None, device=None, fill_value=None):
        """The factory ``kind`` (zeros / ones / empty / full / rand / randn) on ``shape``."""
        raise _unavailable(f"hyper_parallel's DTensor factories ({kind})", self)

    # ---------------------------------------------------------------- shapes and dtypes
    @abc.abstractmethod
    def is_tensor(self, obj):
        """Whether ``obj`` is a framework tensor (a DTensor included)."""

    @abc.abstractmethod
    def broadcast_shapes(self, *shapes):
        """The broadcast of ``shapes`` as a tuple."""

    @abc.abstractmethod
    def is_floating_dtype(self, dtype):
        """Floating or complex ``dtype`` (one that carries gradients)."""

    @abc.abstractmethod
    def is_floating_point(self, tensor):
        """Whether ``tensor`` has a floating dtype."""

    @abc.abstractmethod
    def bool_dtype(self):
        """The framework's bool dtype."""

    @abc.abstractmethod
    def float32(self):
        """The framework's float32 dtype."""

    @staticmethod
    def detach(tensor):
        """``tensor`` cut from the autograd graph, sharing its data (no graph: itself)."""
        return tensor.detach()

    @abc.abstractmethod
    def local_sum(self, tensor, dim=None, keepdim=False):
        """``tensor.sum(dim, keepdim)`` of a local piece; an empty piece gives zeros (zero gradient)."""

    # ---------------------------------------------------------------- autograd plumbing
    @abc.abstractmethod
    def make_autograd_function(self, name, forward, backward):
        """A differentiable callable from ``forward(ctx, *args)`` / ``backward(ctx, *grads)``
        (one gradient per argument, None for non-tensors); DTensor arguments and results work."""

    @abc.abstractmethod
    def no_grad(self):
        """Context manager: record no graph inside."""

    @abc.abstractmethod
    def is_grad_enabled(self):
        """Whether operations are recorded for differentiation now."""

    @abc.abstractmethod
    def requires_grad(self, tensor):
        """Whether ``tensor`` may need a gradient (a framework that decides later: True)."""

    # ---------------------------------------------------------------- module surgery
    @abc.abstractmethod
    def register_forward_pre_hook(self, module, hook, with_kwargs=False):
        """``hook(module, args[, kwargs])`` before every forward; returns a removable handle."""

    @abc.abstractmethod
    def register_forward_hook(self, module, hook, with_kwargs=False):
        """``hook(module, args, [kwargs,] output)`` after every forward; returns a removable handle."""

    def register_grad_ready_hooks(self, params, on_ready, on_backward_end):
        """``on_ready(param)`` once ``param.grad`` holds this backward's gradient, ``on_backward_end()``
        once at the end of each backward that readied one of ``params``; returns a remover."""
        raise _unavailable("register_grad_ready_hooks (gradient-ready hooks)", self)

    @abc.abstractmethod
    def replace_forward(self, module, make_wrapper):
        """Route calls through ``make_wrapper(original_forward)``; returns a restoring function."""

    @abc.abstractmethod
    def is_linear(self, module):
        """Whether ``module`` is the framework's linear layer."""

    @abc.abstractmethod
    def is_embedding(self, module):
        """Whether ``module`` is the framework's embedding layer."""

    @staticmethod
    def embedding_weight_name(module):
        """The name of an embedding module's table parameter (torch: ``weight``)."""
        return "weight"

    @staticmethod
    def named_children(module):
        """(name, child module) pairs (torch's spelling; MindSpore's Cell differs)."""
        return module.named_children()

    @staticmethod
    def named_modules(module):
        """(dotted name, module) pairs, the module itself first as ""."""
        return module.named_modules()

    @abc.abstractmethod
    def named_parameters(self, module, recurse=False):
        """(name, parameter) pairs; a parallelized one as its DTensor."""

    @abc.abstractmethod
    def set_parameter(self, module, name, value):
        """Make ``module.<name>`` the DTensor ``value`` (a parameter of the framework's optimizers)."""

    @staticmethod
    def named_buffers(module, recurse=False):
        """(name, buffer) pairs of ``module`` (frameworks without buffers: none)."""
        return []

    def set_buffer(self, module, name, value):
        """Replace buffer ``name`` of ``module`` by ``value``."""
        raise _unavailable("set_buffer (module buffers)", self)

    # ---------------------------------------------------------------- attention kernels
    @abc.abstractmethod
    def sdpa(self, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        """Scaled dot-product attention on (..., heads, seq, dim) tensors."""

    @abc.abstractmethod
    def attention_block_forward(self, q, k, v, causal=False, scale=None, mask=None, softcap=None):
        """(out, fp32 log-sum-exp) over a key block (b, h, s, d); mask: bool; softcap c: s -> c·tanh(s/c)."""

    @abc.abstractmethod
    def attention_block_backward(self, grad_out, q, k, v, out, lse, causal=False, scale=None, mask=None,
                                 softcap=None):
        """(dq, dk, dv) of one key block, given the final output and log-sum-exp of the row."""

    # ---------------------------------------------------------------- dispatch hooks
    # Core's dispatchers ask these about an op; the defaults are those of a framework whose ops
    # reach a DTensor at one level only (MindSpore: PyNative ops return new tensors, never views).
    @staticmethod
    def op_display_name(func):
        """The op's name in messages and rule lookups."""
        return getattr(func, "__name__", None) or str(func)

    @staticmethod
    def aten_kind(func):
        """How the level below autograd treats ``func`` (torch's aten_kinds.py), None: no such level."""
        return None

    @staticmethod
    def foreach_to_single(func, args=None, kwargs=None):
        """A multi-tensor op as its per-position single-tensor calls, or None."""
        return None

    @staticmethod
    def op_returns_nothing(func):
        """Whether an op below autograd returns nothing (in-place foreach ops)."""
        return False

    @staticmethod
    def loss_parallel_unsupported():
        """Why ``loss_parallel()``'s rules cannot reach this framework's cross-entropy, or None."""
        return None

    @staticmethod
    def written_arguments(func):
        """(position, name) of every argument an op below autograd writes into."""
        return ()

    @staticmethod
    def alias_view_wrappers(func, args, kwargs, out):
        """Make a view op's output wrapper(s) alias the input's, for autograd's view tracking."""
        return out

    @staticmethod
    def shares_memory(a, b):
        """Whether two tensors are views of one storage."""
        return False

    @staticmethod
    def materialize(tensor):
        """A tensor with any lazy bits (torch's conjugate / negative views) applied."""
        return tensor

    def apply_to_wrapper(self, func, wrapper, args, kwargs):
        """Run a metadata-only in-place op on a DTensor's wrapper itself (its global shape)."""
        raise _unavailable("in-place shape ops on a DTensor's wrapper", self)
