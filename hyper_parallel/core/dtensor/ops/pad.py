"""constant padding (``F.pad(x, pad, mode="constant", value)``, aten ``constant_pad_nd``).

The padded dims are gathered (a shard's edge is not the tensor's edge: padding each piece would
put the pad value between pieces); every other shard is kept. A Partial passes through only a zero
pad (padding is then linear: the pieces' zeros reduce to zero); a non-zero value would be added
once per rank, so the Partial is reduced first. Other modes (reflect, replicate, circular) read
neighbouring values across the edge: the replicated fallback.
"""
from typing import Any
from hyper_parallel.core.dtensor.ops.gather_dims import gather_dims
from hyper_parallel.core.dtensor.ops.registry import OpStrategy, register_rule


def _mode_and_value(call):
    """F.pad(input, pad, mode, value) and constant_pad_nd(self, pad, value) put the value in
    different positions; a str third argument is F.pad's mode."""
    third = call.arg(2, "mode", "constant")
    if isinstance(third, str):
        return third, call.arg(3, "value", None)
    return "constant", call.kwargs.get("value", third)


@register_rule("pad")
def pad_rule(call: Any) -> Any:
    x, pad = call.arg(0, "input", call.kwargs.get("self")), call.arg(1, "pad")
    spec = call.spec(x)
    mode, value = _mode_and_value(call)
    if spec is None or call.index(x) != 0 or len(call.specs) != 1 or mode != "constant" \
            or not isinstance(pad, (list, tuple)) or len(pad) % 2 or len(pad) // 2 > spec.ndim:
        return None
    padded = {spec.ndim - 1 - i for i in range(len(pad) // 2) if pad[2 * i] or pad[2 * i + 1]}
    inputs, outputs = gather_dims(spec, padded, lambda d: d, partial_stays=not value)
    return OpStrategy(inputs=[inputs], outputs=outputs)


__all__ = ["pad_rule"]
