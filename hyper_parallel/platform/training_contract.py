"""The training-loop part of the platform contract (``Platform`` in base.py inherits it).

The gradient reducer's members (core/data_parallel/reducer.py, for data_parallel and fully_shard on
every platform): how gradients become ready (per-parameter hooks on torch; one tuple handed to the
training step's ``grad_reducer`` on MindSpore), tensor sizes, and the flat buffer one collective
reduces. Layout checkpoints on such a framework; the defaults are those of torch.
"""
import math
from typing import Any, Callable, List, Sequence


def unavailable(what, platform):
    return NotImplementedError(f"{what} is not available on the {platform.name} platform")


class GradientReducerContract:
    """Declared members of the one gradient reducer (core/data_parallel/reducer.py)."""

    # True: gradients become ready all at once, as the tuple a training step hands its grad_reducer
    # (install_grad_reducer); False: one by one, through register_grad_ready_hooks (base.py)
    gradients_as_tuple = False

    def install_grad_reducer(self, cell, reduce_fn: Callable, who: str) -> bool:
        """Make ``reduce_fn(grads) -> grads`` the gradient reducer of a training-step module (the
        "gradients ready" event of a tuple-gradient framework); False where ``cell`` has none."""
        raise unavailable("install_grad_reducer", self)

    def tensor_nbytes(self, tensor) -> int:
        """Bytes of ``tensor``'s elements (bucket sizes), from its shape and the framework's element size."""
        platform: Any = self   # a Platform: dtype_itemsize is declared in compute_state_contract.py
        return math.prod(int(s) for s in tuple(tensor.shape)) * platform.dtype_itemsize(tensor.dtype)

    def pack_flat(self, tensors: Sequence, extra: Sequence[float] = ()):
        """One 1-D buffer: every tensor flattened, in order, then ``extra`` (flag values) in their dtype."""
        platform: Any = self   # a Platform: tensor and cat are declared in base.py
        pieces = [t.reshape(-1) for t in tensors]
        if extra:
            pieces.append(platform.tensor(list(extra), dtype=tensors[0].dtype, device=tensors[0].device))
        return platform.cat(pieces, 0)

    def unpack_flat(self, flat, shapes: Sequence[tuple]) -> List:
        """The tensors ``pack_flat`` packed, as views of ``flat`` in ``shapes`` (what follows is ignored)."""
        out, offset = [], 0
        for shape in shapes:
            n = math.prod(shape)
            out.append(flat[offset:offset + n].reshape(tuple(shape)))
            offset += n
        return out


class ShardedDataParallelContract(GradientReducerContract):
    """Declared members fully_shard uses (core/fully_shard; torch: platform/torch/fully_shard_support.py)."""

    def free_storage(self, tensor):
        """Release ``tensor``'s memory, keeping the tensor object (autograd's saved references stay valid)."""
        raise unavailable("free_storage (fully_shard)", self)

    def alloc_storage(self, tensor):
        """Give a tensor freed by ``free_storage`` memory for its whole shape again (contents undefined)."""
        raise unavailable("alloc_storage (fully_shard)", self)

    def untracked(self, tensor):
        """An alias of ``tensor``'s memory whose writes autograd does not see (no version bump)."""
        raise unavailable("untracked (fully_shard)", self)

    def swap_parameter(self, module, name, value):
        """Make ``module.<name>`` the tensor object ``value`` itself (no new parameter object)."""
        raise unavailable("swap_parameter (fully_shard)", self)

    def register_multi_grad_hook(self, tensors, hook, mode="any"):
        """``hook()`` once per backward, when the first gradient of any of ``tensors`` is computed
        (``mode="all"``: once backward has computed all of theirs that it reaches)."""
        raise unavailable("register_multi_grad_hook (fully_shard)", self)

    def is_autograd_leaf(self, tensor):
        """Whether autograd created ``tensor`` outside any recorded operation (a leaf: no node to
        hook before it, only its gradient accumulation)."""
        raise unavailable("is_autograd_leaf (fully_shard)", self)

    def queue_backward_callback(self, callback):
        """Run ``callback()`` once the current backward pass has finished (called during backward)."""
        raise unavailable("queue_backward_callback (fully_shard)", self)

    def register_optimizer_step_pre_hook(self, hook):
        """``hook(optimizer, args, kwargs)`` before every optimizer step (fully_shard checks that an
        optimizer holds the parameters the model uses); frameworks without such a hook: none."""
        return None

    def register_grad_arrival_hook(self, param, hook):
        """``hook(param)`` when a backward delivers a gradient for ``param``, before it is added to
        ``param.grad`` (data_parallel); returns a handle with ``remove()``."""
        raise unavailable("register_grad_arrival_hook (data_parallel)", self)


class TrainingLoopContract(ShardedDataParallelContract):
    """Declared members of the training loop (MindSpore: training.py implements them)."""

    @staticmethod
    def check_execution_mode(who):
        """Raise, naming ``who``, where the framework's current mode cannot run hyper_parallel."""

    def forward_backward(self, fn, inputs):
        """Run ``fn(*inputs)`` on the inputs taken as new leaves, and its backward seeded with ones
        (for timing a call, as ``mode="auto"`` does; also where gradients are off outside)."""
        raise unavailable("forward_backward", self)

    @staticmethod
    def dense(tensor):
        """``tensor`` itself where its elements fill its memory once each (a transpose of a contiguous
        tensor...), else a contiguous copy: an activation's gradient in a layout any op accepts,
        without copying a merely permuted one (torch; elsewhere always contiguous)."""
        return tensor.contiguous()

    @staticmethod
    def train_step_network(cell):
        """The network a training-step module trains, or ``cell`` itself."""
        return cell

    def save_tensor_file(self, path, named_tensors):
        """Write ``{name: tensor}`` in the framework's checkpoint format."""
        raise unavailable("save_tensor_file (framework checkpoint files)", self)

    def load_tensor_file(self, path):
        """``{name: numpy array}`` of a file written by ``save_tensor_file``."""
        raise unavailable("load_tensor_file (framework checkpoint files)", self)

    @staticmethod
    def parameter_name(param):
        """The name a parameter is saved under."""
        return param.name

    def assign_parameter(self, param, array):
        """Overwrite ``param``'s values in place from a numpy array."""
        raise unavailable("assign_parameter", self)
