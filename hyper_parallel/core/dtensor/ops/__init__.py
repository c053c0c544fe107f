"""Sharding rules. Importing this package registers every rule module."""
from hyper_parallel.core.dtensor.ops.registry import OpCall, OpStrategy, get_rule, register_rule, registered_ops
from hyper_parallel.core.dtensor.ops import (  # noqa: F401  (registration side effects)
    addmm,
    advanced_index,
    attention,
    concat,
    dropout,
    elementwise,
    einsum,
    embedding,
    factories_like,
    flip,
    index_ops,
    logsumexp,
    loss,
    mse_loss,
    nll_loss,
    matmul,
    norms,
    npu_attention,
    pad,
    reductions,
    slicing,
    scan,
    softmax,
    statistics,
    vector_norm,
    view,
    whole_dim,
)

__all__ = ["OpCall", "OpStrategy", "get_rule", "register_rule", "registered_ops"]
