"""Ascend NPU platform: PyTorch + torch_npu, device ``npu``, backend ``hccl``."""
import torch

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

    def __init__(self):
        self.torch_npu = _import_torch_npu()
        super().__init__()

    @property
    def device_type(self):
        return "npu"

    @property
    def default_backend(self):
        return "hccl"

    def _device_module(self):
        return torch.npu

    def capabilities(self):
        table = super().capabilities()
        table["attention kernel"] = "torch_npu.npu_fusion_attention"
        return table

    def npu_fusion_attention(self, *args, **kwargs):
        return self.torch_npu.npu_fusion_attention(*args, **kwargs)
