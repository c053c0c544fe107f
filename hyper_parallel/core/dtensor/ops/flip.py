"""flip(x, dims): reverses the listed dims.

A flipped dim that a mesh dim splits is gathered: reversing it would send rank i's piece to rank
n-1-i, and torch.chunk's uneven pieces do not mirror (7 rows on 4 ranks: 2,2,2,1). Every other
shard is kept, and a Partial passes through (flip only moves values). It reaches DTensors in the
backward of cumsum and as ``torch.flip``.
"""
from typing import Any
from hyper_parallel.core.dtensor.ops.gather_dims import gather_dims
from hyper_parallel.core.dtensor.ops.registry import OpStrategy, register_rule


@register_rule("flip")
def flip_rule(call: Any) -> Any:
    x, dims = call.arg(0, "input"), call.arg(1, "dims")
    spec = call.spec(x)
    if spec is None or call.index(x) != 0 or not isinstance(dims, (list, tuple)):
        return None
    flipped = {d % max(spec.ndim, 1) for d in dims}
    inputs, outputs = gather_dims(spec, flipped, lambda d: d, partial_stays=True)
    return OpStrategy(inputs=[inputs], outputs=outputs)


__all__ = ["flip_rule"]
