"""Sharding rules. Importing this package registers every rule module (the aten-level forms live in
``core/dtensor/aten/``; their rule modules are registered here too)."""
from hyper_parallel.core.dtensor.ops.registry import (OpCall, OpStrategy, get_rule, register_rule,
                                                      registered_ops)
from hyper_parallel.core.dtensor.aten import (  # noqa: F401  (registration side effects)
    aten_embedding,
    aten_layout_ops,
    aten_norms,
    aten_pointwise,
    aten_spatial,
)
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
