"""Ascend NPU platform: PyTorch + torch_npu, device ``npu``, backend ``hccl``.

Everything else is the torch platform's: torch_npu registers the ``npu`` device with PyTorch, so
tensors, autograd, ``torch.distributed`` (with HCCL) and the DTensor base are the same classes.
What differs: the device module (``torch.npu``: set_device, synchronize, memory statistics,
streams and events), the default backend, and the attention kernel
``torch_npu.npu_fusion_attention``, whose calls on DTensors are routed to core's
``npu_fusion_attention`` sharding rule (see ``op_names.py`` and
``core/dtensor/ops/npu_attention*.py``).
"""
from typing import Any
import torch

from hyper_parallel.platform.handles import AsyncHandle
from hyper_parallel.platform.npu.op_names import register_npu_op_names
from hyper_parallel.platform.torch.platform import TorchPlatform


def _import_torch_npu():
    try:
        import torch_npu  # noqa: F401  (registers the npu device with torch)
    except ImportError as exc:
        raise ImportError(
            "HP_PLATFORM=npu needs torch_npu (and Ascend CANN): install it with "
            "`pip install 'hyper-parallel[npu]'` on an Ascend machine, or choose "
            "HP_PLATFORM=torch") from exc
    return torch_npu


class NpuPlatform(TorchPlatform):
    name = "npu"

    def __init__(self) -> None:
        self.torch_npu = _import_torch_npu()
        super().__init__()
        self.npu_op_functions = register_npu_op_names(self.torch_npu)

    # ---------------------------------------------------------------- device
    @property
    def device_type(self) -> str:
        return "npu"

    @property
    def default_backend(self) -> str:
        return "hccl"

    def _device_module(self):
        return torch.npu

    # ---------------------------------------------------------------- streams and events
    def current_stream(self) -> Any:
        return self._device_module().current_stream()

    def new_stream(self) -> Any:
        return self._device_module().Stream()

    def stream(self, stream: Any) -> Any:
        """Context manager: kernels launched inside run on ``stream``."""
        return self._device_module().stream(stream)

    def new_event(self, enable_timing: bool = False) -> Any:
        return self._device_module().Event(enable_timing=enable_timing)

    # ---------------------------------------------------------------- collectives
    def reduce_scatter(self, tensor: Any, group: Any, dim: int = 0, op: str = "sum",
                       async_op: bool = False) -> Any:
        """HCCL has no AVG reduction: reduce-scatter the sum, then divide by the group size."""
        if op != "avg":
            return super().reduce_scatter(tensor, group, dim, op, async_op)
        n = self.get_world_size(group)
        result = super().reduce_scatter(tensor, group, dim, "sum", async_op)
        if not async_op:
            return result / n
        return AsyncHandle([result], lambda: result.wait() / n)

    # ---------------------------------------------------------------- capabilities
    def capabilities(self) -> Any:
        table = super().capabilities()
        if table.get("backend") != "gloo":
            # the torch collectives divide a sum for avg on every backend but NCCL; HCCL has no AVG
            table["all_reduce avg"] = "emulated: sum, then divide by the group size"
            table["reduce_scatter avg"] = "emulated: reduce-scatter the sum, then divide by the group size"
        table["attention kernel"] = "torch_npu.npu_fusion_attention"
        return table

    # ---------------------------------------------------------------- attention kernels
    def npu_fusion_attention(self, *args: Any, **kwargs: Any) -> Any:
        """``torch_npu.npu_fusion_attention``; on DTensors it runs through the sharding rule."""
        return self.torch_npu.npu_fusion_attention(*args, **kwargs)
