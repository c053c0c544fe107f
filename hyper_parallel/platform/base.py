"""The framework-neutral surface every platform implements.

``core/`` only ever talks to this interface (through ``get_platform()``), so the same DTensor,
tensor-parallel and context-parallel code runs on PyTorch, Ascend NPU and MindSpore.
"""
import threading

REDUCE_OPS = ("sum", "avg", "max", "min")


class AsyncHandle:
    """Result of an ``async_op=True`` collective: ``wait()`` returns the output tensor(s)."""

    def __init__(self, works, finish):
        self._works = list(works)
        self._finish = finish
        self._result = None
        self._done = False

    def wait(self):
        if not self._done:
            for work in self._works:
                work.wait()
            self._result = self._finish()
            self._done = True
        return self._result


class CompletedHandle(AsyncHandle):
    """An async handle for work that already finished (emulated collectives run eagerly)."""

    def __init__(self, result):
        super().__init__((), lambda: result)


class Platform:
    """Abstract platform. Subclasses fill in every method below."""

    name = "abstract"
    # Framework classes exposed to core and to users.
    Tensor = None
    Module = None
    Parameter = None
    DTensorBase = None

    def __init__(self):
        self._comm_observers = []
        self._observer_lock = threading.Lock()

    # ---------------------------------------------------------------- communication accounting
    def add_comm_observer(self, observer):
        """``observer(op_name, bytes_sent, group_ranks)`` is called for every collective."""
        with self._observer_lock:
            self._comm_observers.append(observer)

    def remove_comm_observer(self, observer):
        with self._observer_lock:
            self._comm_observers.remove(observer)

    def record_comm(self, op_name, bytes_sent, group_ranks):
        for observer in list(self._comm_observers):
            observer(op_name, bytes_sent, group_ranks)

    # ---------------------------------------------------------------- capability table
    def capabilities(self):
        """``{collective: "native" | "emulated: how"}`` for the current backend."""
        raise NotImplementedError

    # ---------------------------------------------------------------- process groups
    def init_process_group(self, backend=None, **kwargs):
        raise NotImplementedError

    def is_initialized(self):
        raise NotImplementedError

    def get_rank(self, group=None):
        raise NotImplementedError

    def get_world_size(self, group=None):
        raise NotImplementedError

    def new_group(self, ranks):
        """The process group of ``ranks`` (a tuple of global ranks), created once and cached.

        Every rank must call this for every group, in the same order (the collective nature of
        group creation); DeviceMesh guarantees that.
        """
        raise NotImplementedError

    def group_ranks(self, group):
        raise NotImplementedError

    def barrier(self, group=None):
        raise NotImplementedError

    def destroy_process_group(self):
        raise NotImplementedError

    # ---------------------------------------------------------------- raw collectives
    # Each returns the result, or an AsyncHandle when async_op=True. Inputs may be
    # non-contiguous; outputs are new contiguous tensors.
    def all_gather(self, tensor, group, dim=0, async_op=False):
        raise NotImplementedError

    def all_to_all_single(self, tensor, group, split_dim=0, concat_dim=0, async_op=False):
        raise NotImplementedError

    def all_to_all(self, tensors, group, out_shapes=None, async_op=False):
        """List form: ``tensors[i]`` goes to group rank i; returns the list received, the piece
        from group rank j shaped ``out_shapes[j]`` (default: ``tensors[j].shape``)."""
        raise NotImplementedError

    def reduce_scatter(self, tensor, group, dim=0, op="sum", async_op=False):
        raise NotImplementedError

    def all_reduce(self, tensor, group, op="sum", async_op=False, tag=None):
        """``tag`` names the call in communication accounting (default "all_reduce")."""
        raise NotImplementedError

    def broadcast(self, tensor, src, group, async_op=False):
        """``src`` is a global rank; returns the broadcast tensor on every rank."""
        raise NotImplementedError

    def p2p_exchange(self, sends, recvs, group=None, async_op=False):
        """Batched point-to-point: ``sends`` = [(tensor, global_dst)], ``recvs`` =
        [(template_tensor, global_src)] whose shape/dtype the received tensors take."""
        raise NotImplementedError

    # ---------------------------------------------------------------- autograd-aware collectives
    def differentiable_all_gather(self, tensor, group, dim=0):
        raise NotImplementedError

    def differentiable_reduce_scatter(self, tensor, group, dim=0):
        raise NotImplementedError

    def differentiable_all_to_all(self, tensor, group, split_dim, concat_dim):
        raise NotImplementedError

    def differentiable_all_reduce(self, tensor, group, op="sum"):
        raise NotImplementedError

    def differentiable_p2p_exchange(self, tensor, send_to, recv_from, group=None):
        raise NotImplementedError

    # ---------------------------------------------------------------- modules and hooks
    def register_forward_pre_hook(self, module, hook, with_kwargs=False):
        raise NotImplementedError

    def register_forward_hook(self, module, hook, with_kwargs=False):
        raise NotImplementedError

    def register_grad_ready_hooks(self, params, on_ready, on_backward_end):
        """``on_ready(param)`` once ``param.grad`` holds this backward's gradient, ``on_backward_end()``
        once at the end of each backward that readied one of ``params``; returns a remover."""
        raise NotImplementedError

    def is_linear(self, module):
        raise NotImplementedError

    def is_embedding(self, module):
        raise NotImplementedError

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

    @staticmethod
    def named_buffers(module, recurse=False):
        """(name, buffer) pairs of ``module`` (frameworks without buffers: none)."""
        return []

    @staticmethod
    def set_buffer(module, name, value):
        raise NotImplementedError

    @staticmethod
    def create_tensor(kind, shape, dtype=None, device=None, fill_value=None):
        """The factory ``kind`` (zeros / ones / empty / full / rand / randn) on ``shape``."""
        raise NotImplementedError(f"hyper_parallel's DTensor factories ({kind}) are not available on this "
                                  f"platform yet")

    # ---------------------------------------------------------------- device, dtype, memory
    @property
    def device_type(self):
        raise NotImplementedError

    @property
    def default_backend(self):
        raise NotImplementedError

    # ---------------------------------------------------------------- the level below autograd
    # Core's aten-level dispatch (writes through views, in-place ops) asks these; a framework
    # without such a level (MindSpore: PyNative ops return new tensors, never views) keeps them.
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

    # ---------------------------------------------------------------- tensor helpers for core
    @staticmethod
    def local_sum(tensor, dim=None, keepdim=False):
        """``tensor.sum(dim=dim, keepdim=keepdim)`` of a local piece; an empty piece gives zeros
        (zero gradient)."""
        raise NotImplementedError
