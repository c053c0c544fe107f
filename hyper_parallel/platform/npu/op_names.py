"""Make torch_npu's fused attention kernel reach core's ``npu_fusion_attention`` sharding rule.

The torch DTensor base (``platform/torch/dtensor_base.py``) maps the callables its
``__torch_function__`` receives to neutral op names through ``OP_NAMES``. torch_npu's kernel is
not in that table until torch_npu is loaded, so the NPU platform adds it here. Every spelling a
call can arrive with is registered: the public ``torch_npu.npu_fusion_attention``, the binding
object it is taken from (``torch_npu._C._VariableFunctions``), and the dispatcher op
``torch.ops.npu.npu_fusion_attention`` (packet and ``.default`` overload), whichever of them exist
in the installed torch_npu version.
"""
from typing import Any
import torch

from hyper_parallel.platform.torch.dtensor_base import OP_NAMES

NPU_OPS = ("npu_fusion_attention",)


def _candidates(torch_npu, name):
    found = [getattr(torch_npu, name, None)]
    functions = getattr(getattr(torch_npu, "_C", None), "_VariableFunctions", None)
    found.append(getattr(functions, name, None))
    try:
        packet = getattr(torch.ops.npu, name)
    except (AttributeError, RuntimeError):
        packet = None
    if packet is not None:
        found.extend([packet, getattr(packet, "default", None)])
    unique = []
    for func in found:
        if func is not None and callable(func) and all(func is not f for f in unique):
            unique.append(func)
    return unique


def register_npu_op_names(torch_npu: Any, table: Any = None) -> Any:
    """Map torch_npu's kernels (those in ``NPU_OPS`` that the module has) to their neutral op names
    in ``table`` (default: the DTensor base's ``OP_NAMES``). Returns the callables registered.

    ``NpuPlatform`` calls this with the real torch_npu; tests call it with the CPU emulation in
    ``tests/npu_emulation`` so that the NPU code path runs on CPU/gloo."""
    table = OP_NAMES if table is None else table
    registered = []
    for name in NPU_OPS:
        for func in _candidates(torch_npu, name):
            table[func] = name
            registered.append(func)
    return registered
