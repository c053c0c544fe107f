"""torch's element sizes and default computation state (platform/compute_state_contract.py)."""
from typing import Any
import contextlib

import torch

# the device types whose autocast a caller may have entered
_AUTOCAST_DEVICES = ("cpu", "cuda", "xpu", "mps", "hpu")


class TorchComputeState:
    @staticmethod
    def dtype_itemsize(dtype: Any) -> int:
        return int(dtype.itemsize)

    @staticmethod
    def default_compute_state() -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        stack.enter_context(torch.inference_mode(False))
        stack.enter_context(torch.enable_grad())
        for device in _AUTOCAST_DEVICES:
            try:
                enabled = torch.is_autocast_enabled(device)
            except (RuntimeError, ValueError):   # a device type this build does not know
                continue
            if enabled:
                stack.enter_context(torch.autocast(device, enabled=False))
        return stack
