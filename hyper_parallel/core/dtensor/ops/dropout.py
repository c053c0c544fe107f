"""F.dropout(input, p, training, inplace) and torch.dropout(input, p, train): elementwise.

The output has the input's placements, except that a Partial input is reduced to Replicate first
(a random mask does not commute with the sum over ranks). When dropout is the identity
(``p == 0`` or not training) a Partial input stays Partial and nothing moves.

Randomness: a sharded dropout equals the single-device dropout of the full tensor under the same
seed. Every rank draws the mask of the whole tensor (dropout of a tensor of ones: the kept
elements scaled by 1/(1-p), the same draws one device makes for the full input) and multiplies
its own shard by its piece of it. The ranks' generators must therefore be seeded alike, as for
PyTorch DTensor; they then stay in step, since every rank draws the same number of values. The
price is a full-size draw on every rank. ``inplace=True`` runs at the aten level, where random
ops draw the same way.
"""
from typing import Any
from hyper_parallel.core.dtensor.layout import local_box
from hyper_parallel.core.dtensor.ops.registry import OpStrategy, register_rule
from hyper_parallel.core.dtensor.placement_types import Replicate
from hyper_parallel.platform import get_platform


def _is_identity(call):
    training = call.arg(2, "training", call.kwargs.get("train", True))
    p = call.arg(1, "p", 0.5)
    return not training or p == 0


def _whole_mask_local(spec_placements):
    def dropout_with_whole_mask(call, args, kwargs):
        x = args[0] if args else kwargs["input"]
        shape = call.out_shapes[0]
        ones = get_platform().zeros(shape, dtype=x.dtype, device=getattr(x, "device", None)) + 1
        rest = {k: v for k, v in kwargs.items() if k != "input"}
        mask = call.func(ones, *args[1:], **rest)
        mesh = call.mesh
        box = local_box(shape, spec_placements, mesh.mesh_shape, mesh.get_coordinate())
        return x * mask[tuple(slice(start, start + size) for start, size in box)]
    return dropout_with_whole_mask


@register_rule("dropout")
def dropout_rule(call: Any) -> Any:
    x = call.arg(0, "input")
    spec = call.spec(x)
    if spec is None or call.index(x) != 0 or call.arg(3, "inplace", False):
        return None
    identity = _is_identity(call)
    placements = tuple(Replicate() if p.is_partial() and not identity else p for p in spec.placements)
    local = None if identity else _whole_mask_local(placements)
    return OpStrategy(inputs=[placements] + [None] * (len(call.specs) - 1), outputs=placements, local=local)


__all__ = ["dropout_rule"]
