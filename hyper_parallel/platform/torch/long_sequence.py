"""torch's members of the long-sequence contract (platform/long_sequence_contract.py)."""
from typing import Any
import torch
import torch.utils.checkpoint


class TorchLongSequence:
    @staticmethod
    def add_rows(target: Any, index: Any, source: Any) -> Any:
        return target.index_add_(0, index, source)

    @staticmethod
    def recompute(function: Any, *args: Any) -> Any:
        # non-reentrant: works when only some inputs need gradients, and nests inside HF's own checkpointing
        return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)

    @staticmethod
    def saved_tensors_hooks(pack: Any, unpack: Any) -> Any:
        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    @staticmethod
    def host_copy(tensor: Any) -> Any:
        # parameters stay where they are anyway; a subclass (DTensor) has no storage of its own to move
        if type(tensor) is not torch.Tensor or tensor.numel() == 0:
            return None
        if tensor.device.type == "cpu":     # already host memory: a copy keeps the same code path exact
            return tensor.detach().clone()
        pin = torch.cuda.is_available() or hasattr(torch, "npu")
        host = torch.empty(tensor.shape, dtype=tensor.dtype, layout=tensor.layout, pin_memory=pin)
        host.copy_(tensor.detach(), non_blocking=pin)
        return host

    @staticmethod
    def device_copy(host: Any, device: Any) -> Any:
        return host.to(device, non_blocking=host.is_pinned())
