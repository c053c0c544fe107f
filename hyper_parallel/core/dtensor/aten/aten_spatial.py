"""Aten ops over the spatial dims of (N, C, *spatial) tensors: convolution (+ backward), upsampling
(+ backward), reflection / replication padding (+ backward).

Each output position reads a window of neighbouring input positions, so a split spatial dim would
need its neighbours' edges: spatial dims are gathered. What stays split:

* convolution: the batch dim N (each sample is convolved alone with the replicated weight). In the
  backward, grad_input follows N; grad_weight and grad_bias sum over the samples, so a split N
  leaves each rank a part of the sum: Partial(sum).
* upsampling: N and C (each channel of each sample is interpolated alone). The backward kernel is
  told the input's size: each rank passes its own N and C.
* padding: every dim the padding does not touch.
Partial inputs are reduced first.
"""
from typing import Any
from hyper_parallel.core.dtensor.ops.empty_pieces import without_empty_pieces
from hyper_parallel.core.dtensor.ops.gather_dims import gather_dims
from hyper_parallel.core.dtensor.aten.aten_norms import batch_strategy, kept_batch, summed
from hyper_parallel.core.dtensor.ops.registry import OpStrategy, register_aten, register_rule


def _spatial_gathered(spec, dims):
    """gather_dims of ``dims`` (every other shard kept, Partial reduced), with no empty piece."""
    inputs, _ = gather_dims(spec, dims, lambda d: d)
    inputs = without_empty_pieces(spec, inputs)
    return inputs, inputs


@register_rule("aten_convolution")
def convolution_rule(call: Any) -> Any:
    x, weight = call.args[0], call.args[1]
    spec, w_spec = call.spec(x), call.spec(weight)
    if spec is None or w_spec is None or call.index(x) != 0 or spec.ndim != w_spec.ndim:
        return None
    kept = without_empty_pieces(spec, kept_batch(spec, 1))
    return batch_strategy(call, [x], kept, kept)


@register_rule("aten_convolution_backward")
def convolution_backward_rule(call: Any) -> Any:
    grad, x, weight = call.args[0], call.args[1], call.args[2]
    spec = call.spec(x)
    if spec is None or call.spec(grad) is None or call.spec(weight) is None or len(call.args) < 11:
        return None
    kept = without_empty_pieces(spec, kept_batch(spec, 1))
    return batch_strategy(call, [grad, x], kept, [kept] + [summed(kept)] * 2)


_UPSAMPLE = ("upsample_nearest1d", "upsample_nearest2d", "upsample_nearest3d", "_upsample_nearest_exact1d",
             "_upsample_nearest_exact2d", "_upsample_nearest_exact3d", "upsample_linear1d",
             "upsample_bilinear2d", "upsample_bicubic2d", "upsample_trilinear3d",
             "_upsample_bilinear2d_aa", "_upsample_bicubic2d_aa")


@register_rule("aten_upsample")
def upsample_rule(call: Any) -> Any:
    """upsample_*(self, output_size, ...) and the .vec overloads: N and C keep their shards."""
    spec = call.spec(call.args[0]) if call.args else None
    if spec is None or call.index(call.args[0]) != 0 or spec.ndim < 3:
        return None
    inputs, outputs = _spatial_gathered(spec, set(range(2, spec.ndim)))
    return OpStrategy(inputs=[inputs], outputs=outputs)


@register_rule("aten_upsample_backward")
def upsample_backward_rule(call: Any) -> Any:
    """upsample_*_backward(grad_output, output_size, input_size, ...): grad_output's N and C keep
    their shards; the kernel gets this rank's N and C in input_size."""
    spec = call.spec(call.args[0]) if call.args else None
    if spec is None or len(call.args) < 3 or call.kwargs or spec.ndim < 3:
        return None
    inputs, outputs = _spatial_gathered(spec, set(range(2, spec.ndim)))

    def upsample_backward_on_shard(call_, args, kwargs):
        grad = args[0]
        input_size = [grad.shape[0], grad.shape[1]] + list(args[2][2:])
        return call_.func(grad, args[1], input_size, *args[3:])
    return OpStrategy(inputs=[inputs], outputs=outputs, local=upsample_backward_on_shard)


_PADS = tuple(f"{kind}_pad{n}d" for kind in ("reflection", "replication") for n in (1, 2, 3))


@register_rule("aten_edge_pad")
def edge_pad_rule(call: Any) -> Any:
    """reflection / replication_pad{1,2,3}d(self, padding) and their backward (grad_output, self,
    padding): the padded dims (the last len(padding) / 2) are gathered; every tensor of the call
    takes the same layout (self only gives its shape to the backward)."""
    backward = call.name.endswith("_backward")
    x = call.args[0]
    padding = call.args[2 if backward else 1] if len(call.args) > (2 if backward else 1) else None
    spec = call.spec(x)
    if spec is None or call.index(x) != 0 or not isinstance(padding, (list, tuple)) or call.kwargs:
        return None
    padded = set(range(spec.ndim - len(padding) // 2, spec.ndim))
    inputs, outputs = _spatial_gathered(spec, padded)
    return OpStrategy(inputs=[inputs] * len(call.specs), outputs=outputs)


register_rule("aten_edge_pad_backward")(edge_pad_rule)

register_aten("aten_convolution", "convolution")
register_aten("aten_convolution_backward", "convolution_backward")
register_aten("aten_upsample", *_UPSAMPLE)
register_aten("aten_upsample_backward", *[f"{name}_backward" for name in _UPSAMPLE])
register_aten("aten_edge_pad", *_PADS)
register_aten("aten_edge_pad_backward", *[f"{name}_backward" for name in _PADS])

__all__ = ["convolution_rule", "convolution_backward_rule", "upsample_rule", "upsample_backward_rule",
           "edge_pad_rule"]
