"""softmax / log_softmax: the normalised dim must be whole on each rank."""
from hyper_parallel.core.dtensor.ops.registry import OpStrategy, register_rule
from hyper_parallel.core.dtensor.placement_types import Replicate


@register_rule("softmax")
def softmax_rule(call):
    spec = call.specs[0]
    dim = call.arg(1, "dim")
    if dim is None or call.index(call.args[0]) != 0:
        return None
    dim %= max(spec.ndim, 1)
    placements = tuple(Replicate() if p.is_shard(dim) or p.is_partial() else p for p in spec.placements)
    return OpStrategy(inputs=[placements], outputs=placements)
