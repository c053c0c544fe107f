"""The part of the platform contract core/long_sequence uses (``Platform`` in base.py inherits it):
recomputation for ``tiled_mlp`` and saved-tensor hooks plus host copies for ``offload_activations``.

The defaults are those of a framework without the concept (each raises ``NotImplementedError``
naming the feature); torch (platform/torch/long_sequence.py) and MindSpore
(platform/mindspore/long_sequence.py) implement them. chunked_cross_entropy needs only ``add_rows``,
whose default here is plain tensor algebra.
"""
from typing import Any, Callable
from hyper_parallel.platform.training_contract import unavailable


class LongSequenceContract:
    """Declared members of tiled_mlp and offload_activations."""

    arange: Callable[..., Any]   # a Platform member (base.py) add_rows uses

    def add_rows(self, target: Any, index: Any, source: Any) -> Any:
        """``target`` with ``source[i]`` added to row ``index[i]`` (repeats accumulate); may update in
        place."""
        # one-hot products in blocks of rows: framework-neutral, O(block x rows of target) at a time
        rows = self.arange(target.shape[0], device=target.device).unsqueeze(1)
        for start in range(0, index.shape[0], 1024):
            one_hot = (rows == index[start:start + 1024].unsqueeze(0)).to(source.dtype)
            target = target + one_hot @ source[start:start + 1024]
        return target

    def recompute(self, function: Any, *args: Any) -> Any:
        """``function(*args)`` keeping only its inputs for backward, run again there (checkpointing)."""
        raise unavailable("recompute (tiled_mlp)", self)

    def saved_tensors_hooks(self, pack: Any, unpack: Any) -> Any:
        """Context manager: each tensor autograd saves inside goes via ``pack``, back via ``unpack``."""
        raise unavailable("saved_tensors_hooks (offload_activations)", self)

    def host_copy(self, tensor: Any) -> Any:
        """A copy of ``tensor`` in host memory (pinned where the device allows), started without waiting;
        None for what should stay (parameters, tensor subclasses such as DTensors)."""
        raise unavailable("host_copy (offload_activations)", self)

    def device_copy(self, host: Any, device: Any) -> Any:
        """The host copy ``host`` back on ``device``, started without waiting."""
        raise unavailable("device_copy (offload_activations)", self)
