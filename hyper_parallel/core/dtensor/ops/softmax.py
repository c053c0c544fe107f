"""softmax / log_softmax: the normalised dim must be whole on each rank."""
from typing import Any
from hyper_parallel.core.dtensor.ops.registry import OpStrategy, register_rule
from hyper_parallel.core.dtensor.placement_types import Replicate


@register_rule("softmax")
def softmax_rule(call: Any) -> Any:
    spec = call.specs[0]
    dim = call.arg(1, "dim")
    if dim is None or call.index(call.args[0]) != 0:
        return None
    dim %= max(spec.ndim, 1)
    placements = tuple(Replicate() if p.is_shard(dim) or p.is_partial() else p for p in spec.placements)
    return OpStrategy(inputs=[placements], outputs=placements)


@register_rule("softmax_backward")
def softmax_backward_rule(call: Any) -> Any:
    """aten ``_softmax_backward_data(grad_output, output, dim, input_dtype)`` (softmin's and
    ``_safe_softmax``'s gradients reach it on DTensors): both tensors whole along ``dim`` and in one
    layout; it is linear in grad_output only, so a Partial is reduced first."""
    grad, out, dim = call.arg(0, "grad_output"), call.arg(1, "output"), call.arg(2, "dim")
    gspec, ospec = call.spec(grad), call.spec(out)
    if gspec is None or ospec is None or not isinstance(dim, int) or gspec.shape != ospec.shape:
        return None
    dim %= max(gspec.ndim, 1)
    placements = tuple(Replicate() if p.is_shard(dim) or p.is_partial() else p for p in gspec.placements)
    return OpStrategy(inputs=[placements, placements], outputs=placements)
