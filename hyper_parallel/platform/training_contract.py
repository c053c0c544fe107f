"""The training-loop part of the platform contract (``Platform`` in base.py inherits it).

Data parallel and layout checkpoints on a framework whose training step receives the gradients as
one tuple (MindSpore's ``TrainOneStepCell``) instead of through per-parameter hooks; the defaults
are those of a framework without that path (torch).
"""


def unavailable(what, platform):
    return NotImplementedError(f"{what} is not available on the {platform.name} platform")


class TrainingLoopContract:
    """Declared members of the training loop (MindSpore: training.py implements them)."""

    # gradients reach the training step as a tuple (core: data_parallel_tuple), not through hooks
    gradients_as_tuple = False

    @staticmethod
    def check_execution_mode(who):
        """Raise, naming ``who``, where the framework's current mode cannot run hyper_parallel."""

    def install_grad_reducer(self, cell, reduce_fn, who):
        """Make ``reduce_fn(grads) -> grads`` the gradient reducer of a training-step module."""
        raise unavailable("install_grad_reducer", self)

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
