"""Elementwise aten ops that torch does not tag pointwise, routed to the elementwise rule.

The aten level sends ops tagged ``pointwise`` (and, since their tag is missing, the in-place forms
of such ops: the platform's aten_kind) through the elementwise rule. These are elementwise too but
carry no tag, so without this list each took the replicated fallback: they are reached when the
forward ran at the aten level (``torch.floor_divide``, F.hardswish / F.logsigmoid on DTensors)
and by the backward ops autograd then runs. None is linear, so a Partial is reduced first (the
elementwise rule's linearity test goes by name).
"""
from typing import Any
from hyper_parallel.core.dtensor.ops.elementwise import elementwise_rule
from hyper_parallel.core.dtensor.ops.registry import OpStrategy, register_aten, register_rule

_ELEMENTWISE = ("floor_divide", "hardswish", "hardswish_backward", "hardsigmoid_backward",
                "log_sigmoid_backward", "elu_backward", "softplus_backward", "leaky_relu_backward",
                "hardtanh_backward", "mish_backward", "hardshrink_backward", "softshrink_backward")
_HAS_IN_PLACE = {"floor_divide", "hardswish"}


@register_rule("log_sigmoid_forward")
def log_sigmoid_forward_rule(call: Any) -> Any:
    """log_sigmoid_forward(self) -> (output, buffer): both elementwise in self's layout."""
    strategy = elementwise_rule(call)
    if strategy is None:
        return None
    return OpStrategy(inputs=strategy.inputs, outputs=[strategy.outputs] * 2, local=_buffer_of_output_shape)


def _buffer_of_output_shape(call, args, kwargs):
    """Some kernels (CUDA) leave the buffer empty and recompute it in the backward, which then never
    reads it; a DTensor's piece must have its layout's shape, so an empty buffer becomes zeros."""
    out, buffer = call.func(*args, **kwargs)
    if tuple(buffer.shape) != tuple(out.shape):
        buffer = out.new_zeros(out.shape)
    return out, buffer


for _name in _ELEMENTWISE:
    register_aten("elementwise", _name, in_place=_name in _HAS_IN_PLACE)
register_aten("log_sigmoid_forward", "log_sigmoid_forward")

__all__ = ["log_sigmoid_forward_rule"]
