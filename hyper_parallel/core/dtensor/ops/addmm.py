"""addmm / baddbmm / addmv: ``beta * input + alpha * (a @ b)``.

The product takes the matmul rule's layout (its candidates and cost search, matmul.py); the added
``input`` then follows the output per mesh dim: a shard of an output dim it has (broadcast dims
replicated), Replicate, or — when the product is a Partial sum of per-rank pieces — the same
Partial, which holds the value on one rank and zeros elsewhere for ``sum`` (the whole value for
``avg``), so that it is added exactly once. A 0-dim plain ``input`` cannot be split that way: a
Partial product is then reduced first. The added input is expanded to the local product's shape
before the op runs: torch's kernels do not broadcast a size-1 input against an EMPTY product
(an uneven shard's empty piece) and would return a piece of the wrong shape.
"""
from typing import Any
from hyper_parallel.core.dtensor.ops.elementwise import to_input
from hyper_parallel.core.dtensor.ops.matmul import _Dims, _operand_placements
from hyper_parallel.core.dtensor.ops.registry import OpStrategy, register_rule
from hyper_parallel.core.dtensor.placement_types import Partial, Replicate

# the (input, a, b) keywords of each op
_NAMES = {"addmm": ("input", "mat1", "mat2"), "baddbmm": ("input", "batch1", "batch2"),
          "addmv": ("input", "mat", "vec")}


def _bias_placement(p, bias_shape, out_shape):
    if p.is_partial():
        return Partial(p.reduce_op)
    return to_input(p, bias_shape, out_shape)


@register_rule(*_NAMES)
def addmm_rule(call: Any) -> Any:
    keys = _NAMES[call.name]
    bias, a, b = (call.arg(i, k) for i, k in enumerate(keys))
    a_spec, b_spec, bias_spec = call.spec(a), call.spec(b), call.spec(bias)
    if a_spec is None or b_spec is None or "out" in call.kwargs:
        return None
    out_shape = tuple(call.out_shapes[0])
    nb = b_spec.ndim
    dims = _Dims(a_spec.shape, b_spec.shape, b_k=0 if nb == 1 else nb - 2, b_n=None if nb == 1 else nb - 1,
                 out_ndim=len(out_shape))
    pa, pb, out = _operand_placements(call, a_spec, b_spec, dims, out_shape)
    if bias_spec is None and any(p.is_partial() for p in out):
        pa = tuple(Replicate() if o.is_partial() else p for p, o in zip(pa, out))
        pb = tuple(Replicate() if o.is_partial() else p for p, o in zip(pb, out))
        out = tuple(Replicate() if o.is_partial() else o for o in out)
    inputs = [None] * len(call.specs)
    inputs[call.index(a)], inputs[call.index(b)] = pa, pb
    if bias_spec is not None:
        inputs[call.index(bias)] = tuple(_bias_placement(p, bias_spec.shape, out_shape) for p in out)
    return OpStrategy(inputs=inputs, outputs=out, local=_expanded_local if bias_spec is not None else None)


def _expanded_local(call, args, kwargs):
    keys = _NAMES[call.name]
    values = [args[i] if i < len(args) else kwargs.pop(k) for i, k in enumerate(keys)]
    bias, a, b = values
    product_shape = tuple(a.shape[:-1]) + (tuple(b.shape[-1:]) if b.ndim > 1 else ())
    return call.func(bias.expand(product_shape), a, b, *args[3:], **kwargs)


__all__ = ["addmm_rule"]
