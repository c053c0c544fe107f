"""MindSpore's members of the long-sequence contract (platform/long_sequence_contract.py);
``add_rows`` keeps the contract's framework-neutral default (no index_add_ kernel on CPU)."""
from typing import Any
import mindspore as ms


class MindSporeLongSequence:
    @staticmethod
    def recompute(function: Any, *args: Any) -> Any:
        # the reentrant form accepts Cells only; tiled_mlp passes a function of one tile
        return ms.recompute(function, *args, use_reentrant=False)

    @staticmethod
    def saved_tensors_hooks(pack: Any, unpack: Any) -> Any:
        return ms.saved_tensors_hooks(pack, unpack)

    @staticmethod
    def host_copy(tensor: Any) -> Any:
        # Parameters stay where they are; a subclass (DTensor) has no storage of its own to move
        if type(tensor) is not ms.Tensor or tensor.size == 0:
            return None
        if str(tensor.device).upper().startswith("CPU"):   # already host memory: a copy, same code path
            return tensor.copy()
        return tensor.move_to("CPU", blocking=False)

    @staticmethod
    def device_copy(host: Any, device: Any) -> Any:
        if str(device).upper().startswith("CPU"):
            return host
        return host.move_to(str(device), blocking=False)
