"""The part of the platform contract core/long_sequence uses (``Platform`` in base.py inherits it):
recomputation for ``tiled_mlp`` and saved-tensor hooks plus host copies for ``offload_activations``.

The defaults are those of a framework without the concept; torch implements them
(platform/torch/long_sequence.py). MindSpore leaves them unimplemented for now (each raises
``NotImplementedError`` naming the feature): chunked_cross_entropy needs none of them.
"""
from hyper_parallel.platform.training_contract import unavailable


class LongSequenceContract:
    """Declared members of tiled_mlp and offload_activations."""

    def recompute(self, function, *args):
        """``function(*args)`` keeping only its inputs for backward, run again there (checkpointing)."""
        raise unavailable("recompute (tiled_mlp)", self)

    def saved_tensors_hooks(self, pack, unpack):
        """Context manager: each tensor autograd saves inside goes via ``pack``, back via ``unpack``."""
        raise unavailable("saved_tensors_hooks (offload_activations)", self)

    def host_copy(self, tensor):
        """A copy of ``tensor`` in host memory (pinned where the device allows), started without waiting;
        None for what should stay (parameters, tensor subclasses such as DTensors)."""
        raise unavailable("host_copy (offload_activations)", self)

    def device_copy(self, host, device):
        """The host copy ``host`` back on ``device``, started without waiting."""
        raise unavailable("device_copy (offload_activations)", self)
