"""The aten forms of layer norm and group norm, forward and backward (``torch.native_layer_norm``,
``torch.native_group_norm``, and the backward ops autograd runs on DTensors for them).

Layer norm normalises over the trailing ``normalized_shape`` dims and group norm over (C, H, W...)
of each sample, so only the dims the statistics do not cross may stay split: the leading dims for
layer norm, the batch dim N for group norm. Shards of those dims are kept on every tensor of the
call (input, grad_out, mean, rstd: the statistics have the same leading dims); any other shard and
any Partial are replicated first (normalisation is not linear). weight and bias are replicated.

Backward: the input gradient follows the input. The weight and bias gradients sum over the leading
dims, so where a mesh dim splits one of them each rank holds a part of the sum: ``Partial(sum)``.
"""
from typing import Any
from hyper_parallel.core.dtensor.ops.empty_pieces import without_empty_pieces
from hyper_parallel.core.dtensor.ops.registry import OpStrategy, register_aten, register_rule
from hyper_parallel.core.dtensor.placement_types import Partial, Replicate


def kept_batch(spec: Any, first_stat_dim: Any) -> Any:
    """Per mesh dim: the input's shard of a dim before ``first_stat_dim`` (one the statistics do not
    cross; rows are independent, so any split of it works), else Replicate."""
    return tuple(p if p.is_shard() and p.dim < first_stat_dim else Replicate() for p in spec.placements)


def summed(kept: Any) -> Any:
    """The placements of a gradient summed over the batch dims ``kept`` splits."""
    return tuple(Partial("sum") if p.is_shard() else Replicate() for p in kept)


def batch_strategy(call: Any, batch_tensors: Any, kept: Any, outputs: Any, local: Any = None) -> Any:
    """``batch_tensors`` laid out as ``kept``, every other DTensor of the call replicated."""
    inputs = [(Replicate(),) * call.mesh_ndim] * len(call.specs)
    for t in batch_tensors:
        inputs[call.index(t)] = kept
    return OpStrategy(inputs=inputs, outputs=outputs, local=local)


def _layer_norm_dims(call, x_pos, shape_pos):
    """(input, first normalised dim), or (None, None) for a call this rule does not read."""
    x, shape = call.args[x_pos], call.args[shape_pos]
    spec = call.spec(x)
    if spec is None or not isinstance(shape, (list, tuple)):
        return None, None
    return x, spec.ndim - len(shape)


@register_rule("native_layer_norm")
def native_layer_norm_rule(call: Any) -> Any:
    x, first = _layer_norm_dims(call, 0, 1)
    if x is None or call.index(x) != 0 or len(call.args) < 5:
        return None
    kept = kept_batch(call.spec(x), first)
    return batch_strategy(call, [x], kept, [kept] * 3)


@register_rule("native_layer_norm_backward")
def native_layer_norm_backward_rule(call: Any) -> Any:
    if len(call.args) < 8:
        return None
    x, first = _layer_norm_dims(call, 1, 2)
    grad, mean, rstd = call.args[0], call.args[3], call.args[4]
    if x is None or any(call.spec(t) is None for t in (grad, mean, rstd)):
        return None
    kept = kept_batch(call.spec(x), first)
    return batch_strategy(call, [grad, x, mean, rstd], kept, [kept] + [summed(kept)] * 2)


def _group_norm_local(n_pos, x_pos):
    """Group norm's kernels take N: each rank passes its own number of samples."""
    def group_norm_on_shard(call, args, kwargs):
        args = list(args)
        args[n_pos] = args[x_pos].shape[0]
        return call.func(*args, **kwargs)
    return group_norm_on_shard


@register_rule("native_group_norm")
def native_group_norm_rule(call: Any) -> Any:
    x = call.args[0]
    spec = call.spec(x)
    if spec is None or call.index(x) != 0 or len(call.args) < 8 or spec.ndim < 2:
        return None
    kept = without_empty_pieces(spec, kept_batch(spec, 1))
    return batch_strategy(call, [x], kept, [kept] * 3, local=_group_norm_local(3, 0))


@register_rule("native_group_norm_backward")
def native_group_norm_backward_rule(call: Any) -> Any:
    if len(call.args) < 10:
        return None
    grad, x, mean, rstd = call.args[:4]
    spec = call.spec(x)
    if spec is None or spec.ndim < 2 or any(call.spec(t) is None for t in (grad, mean, rstd)):
        return None
    kept = without_empty_pieces(spec, kept_batch(spec, 1))
    return batch_strategy(call, [grad, x, mean, rstd], kept, [kept] + [summed(kept)] * 2,
                          local=_group_norm_local(5, 1))


register_aten("native_layer_norm", "native_layer_norm")
register_aten("native_layer_norm_backward", "native_layer_norm_backward")
register_aten("native_group_norm", "native_group_norm")
register_aten("native_group_norm_backward", "native_group_norm_backward")

__all__ = ["batch_strategy", "kept_batch", "summed"]
