"""Elementwise ops with broadcasting.

Per mesh dim the output takes a shard from the largest sharded input (so the big operand does not
move); the other inputs follow it, except along dims they broadcast over, where they are
replicated. Partial inputs survive only through linear ops (sums of partials; a partial scaled by
replicated values); otherwise they are reduced — into the output's shard when there is one, which
is one reduce-scatter.
"""
from typing import Any
from hyper_parallel.core.dtensor.layout import numel
from hyper_parallel.core.dtensor.ops.registry import OpStrategy, register_rule
from hyper_parallel.core.dtensor.placement_types import Replicate
from hyper_parallel.platform import get_platform

ADDITIVE = {"add", "__add__", "__radd__", "sub", "__sub__", "__rsub__", "subtract"}
SCALING = {"mul", "__mul__", "__rmul__", "multiply", "div", "__truediv__", "true_divide", "__div__",
           "divide", "neg", "__neg__", "negative", "positive"}
DIVIDES = {"div", "__truediv__", "true_divide", "__div__", "divide"}
LINEAR_REDUCE_OPS = ("sum", "avg")


def to_output(p: Any, in_shape: Any, out_shape: Any) -> Any:
    """An input's placement seen in output dims (broadcast dims become Replicate)."""
    if not p.is_shard():
        return p
    out_dim = p.dim + len(out_shape) - len(in_shape)
    if in_shape[p.dim] == 1 and out_shape[out_dim] != 1:
        return Replicate()
    return p.with_dim(out_dim)


def to_input(p: Any, in_shape: Any, out_shape: Any) -> Any:
    """The placement an input needs for the output placement ``p``."""
    if not p.is_shard():
        return p
    in_dim = p.dim - (len(out_shape) - len(in_shape))
    if in_dim < 0 or (in_shape[in_dim] == 1 and out_shape[p.dim] != 1):
        return Replicate()
    return p.with_dim(in_dim)


def _linear_partial(op_name, operands, m):
    """The Partial placement the output may keep on mesh dim m, or None."""
    base = op_name.rstrip("_") if not op_name.startswith("__") else op_name
    partials = [o for o in operands if o is not None and o.placements[m].is_partial()]
    if not partials:
        return None
    kind = partials[0].placements[m]
    if kind.reduce_op not in LINEAR_REDUCE_OPS or any(p.placements[m] != kind for p in partials):
        return None
    if base in ADDITIVE and len(partials) == len(operands):
        return kind
    if base in SCALING and len(partials) == 1:
        if base in DIVIDES and operands[0] is not partials[0]:
            return None
        if all(o is None or o is partials[0] or o.placements[m].is_replicate() for o in operands):
            return kind
    return None


def elementwise_strategy(op_name: str, specs: Any, operands: Any, out_shape: Any, mesh_ndim: Any,
                         force_out: Any = None) -> Any:
    """Placements for every spec (the DTensor inputs) and the output.

    ``operands``: the positional operands as specs (None for numbers), for the linearity test.
    ``force_out``: the output placements an in-place op must keep.
    """
    sizes = [numel(s.shape) for s in specs]
    anchor_order = sorted(range(len(specs)), key=lambda i: -sizes[i])
    out: list[Any] = []
    source: list[Any] = []
    for m in range(mesh_ndim):
        if force_out is not None:
            out.append(force_out[m])
            source.append(None)
            continue
        choice, chosen = None, None
        for i in anchor_order:
            cand = to_output(specs[i].placements[m], specs[i].shape, out_shape)
            # Two mesh dims may split one tensor dim (nested Shards, a StridedShard beside the
            # Shard it interleaves with) only when both splits come from the same input, so that
            # the output keeps that input's coherent layout of the dim.
            if cand.is_shard() and not any(o.is_shard(cand.dim) and source[j] != i
                                           for j, o in enumerate(out)):
                choice, chosen = cand, i
                break
        if choice is None:
            choice = _linear_partial(op_name, operands, m) or Replicate()
        out.append(choice)
        source.append(chosen)
    inputs = []
    for s in specs:
        placements = []
        for m, p in enumerate(out):
            if p.is_partial():
                placements.append(s.placements[m] if s.placements[m].is_partial() else Replicate())
            else:
                placements.append(to_input(p, s.shape, out_shape))
        inputs.append(tuple(placements))
    return inputs, tuple(out)


def _operands(call):
    return [call.spec(a) if call.index(a) is not None else None
            for a in call.args if not isinstance(a, (str, type(None)))]


def linearity_name(name: str, kwargs: Any) -> Any:
    """The name the Partial linearity test goes by: a division that rounds (``rounding_mode``) is not
    linear, so it must not pass for ``div``."""
    return f"{name}[rounded]" if kwargs.get("rounding_mode") is not None else name


@register_rule("elementwise")
def elementwise_rule(call: Any) -> Any:
    if not call.specs:
        return None
    name = linearity_name(get_platform().op_display_name(call.func), call.kwargs)
    if name in ("where",) and len(call.args) + len(call.kwargs) < 3:
        return None  # torch.where(cond) returns indices, not an elementwise result
    out_shape = get_platform().broadcast_shapes(*[s.shape for s in call.specs])
    inputs, out = elementwise_strategy(name, call.specs, _operands(call), out_shape, call.mesh_ndim)
    return OpStrategy(inputs=inputs, outputs=out)


__all__ = ["elementwise_strategy", "linearity_name", "to_input", "to_output"]
