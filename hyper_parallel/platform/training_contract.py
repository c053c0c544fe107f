"""The training-loop part of the platform contract (``Platform`` in base.py inherits it).

Data parallel and layout checkpoints on a framework whose training step receives the gradients as
one tuple (MindSpore's ``TrainOneStepCell``) instead of through per-parameter hooks; the defaults
are those of a framework without that path (torch).
"""


def unavailable(what, platform):
    return NotImplementedError(f"{what} is not available on the {platform.name} platform")


class ShardedDataParallelContract:
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

    # gradients reach the training step as a tuple (core: data_parallel_tuple), not through hooks
    gradients_as_tuple = False

    @staticmethod
    def check_execution_mode(who):
        """Raise, naming ``who``, where the framework's current mode cannot run hyper_parallel."""

    def install_grad_reducer(self, cell, reduce_fn, who):
        """Make ``reduce_fn(grads) -> grads`` the gradient reducer of a training-step module."""
        raise unavailable("install_grad_reducer", self)

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

