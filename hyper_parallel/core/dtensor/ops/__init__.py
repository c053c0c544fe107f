"""Sharding rules. Importing this package registers every rule module."""
from hyper_parallel.core.dtensor.ops.registry import OpCall, OpStrategy, get_rule, register_rule, registered_ops
from hyper_parallel.core.dtensor.ops import (  # noqa: F401  (registration side effects)
    attention,
    concat,
    dropout,
    elementwise,
    embedding,
    loss,
    matmul,
    norms,
    npu_attention,
    reductions,
    slicing,
    softmax,
    view,
)

__all__ = ["OpCall", "OpStrategy", "get_rule", "register_rule", "registered_ops"]
