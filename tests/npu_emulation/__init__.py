"""A CPU emulation of torch_npu for tests only (see fake_torch_npu.py and docs/ascend.md)."""
from tests.npu_emulation.fake_torch_npu import (
    INT_MAX, compressed_mask, cpu_npu_platform, install, npu_fusion_attention, npu_path, uninstall,
    visible_keys)

__all__ = ["INT_MAX", "compressed_mask", "cpu_npu_platform", "install", "npu_fusion_attention", "npu_path",
           "uninstall", "visible_keys"]
