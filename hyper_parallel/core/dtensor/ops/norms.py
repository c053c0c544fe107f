"""F.layer_norm(input, normalized_shape, weight, bias, eps) and F.rms_norm(input, normalized_shape,
weight, eps).

The statistics run over the last ``len(normalized_shape)`` dims, so those must be whole on every
rank: a shard of a normalized dim is gathered, other shards stay (the output keeps them). A
Partial input is reduced to Replicate first (normalisation is not linear). ``weight`` and
``bias`` are replicated; with a sharded input their gradients come back as Partial(sum) and are
summed where needed (the dispatcher's gradient semantics).
"""
from typing import Any
from hyper_parallel.core.dtensor.ops.registry import OpStrategy, register_rule
from hyper_parallel.core.dtensor.placement_types import Replicate

_ARGS = {"layer_norm": ("input", "normalized_shape", "weight", "bias", "eps"),
         "rms_norm": ("input", "normalized_shape", "weight", "eps")}


@register_rule("layer_norm", "rms_norm")
def norm_rule(call: Any) -> Any:
    names = _ARGS[call.name]
    x = call.arg(0, names[0])
    spec = call.spec(x)
    shape = call.arg(1, names[1])
    if spec is None or call.index(x) != 0 or shape is None:
        return None
    n_norm = 1 if isinstance(shape, int) else len(shape)
    first = spec.ndim - n_norm
    placements = tuple(Replicate() if p.is_partial() or (p.is_shard() and p.dim >= first) else p
                       for p in spec.placements)
    inputs = [(Replicate(),) * call.mesh_ndim] * len(call.specs)
    inputs[0] = placements
    return OpStrategy(inputs=inputs, outputs=placements)


__all__ = ["norm_rule"]
