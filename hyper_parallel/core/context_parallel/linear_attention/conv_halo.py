"""The short causal convolution before the delta rule, on sequence blocks, exact.

A depthwise causal convolution of kernel K reads the K − 1 tokens before each position, so rank r
needs the last K − 1 input tokens of rank r − 1 (its halo; rank 0's is the zero padding of the
single-device convolution). One batched P2P moves every halo at once; in backward the halo's
gradient goes back to the rank whose tokens it was, in one batched P2P as well.
"""
from typing import Any
from hyper_parallel.core.autograd_functions import lazy_autograd_function
from hyper_parallel.core.context_parallel.linear_attention.checks import agree_conv, check_conv
from hyper_parallel.core.context_parallel.linear_attention.delta_rule import cp_group
from hyper_parallel.platform import get_platform


def _neighbours(group):
    platform = get_platform()
    ranks = list(platform.group_ranks(group))
    rank = platform.get_rank(group)
    return (ranks[rank - 1] if rank > 0 else None), (ranks[rank + 1] if rank + 1 < len(ranks) else None)


def _exchange(send, send_to, template, recv_from, group):
    """Send ``send`` to ``send_to`` and receive a ``template``-shaped tensor from ``recv_from``
    (either may be None); the received tensor, zeros where there is no sender."""
    platform = get_platform()
    sends = [(send.contiguous(), send_to)] if send_to is not None else []
    recvs = [(template, recv_from)] if recv_from is not None else []
    received = platform.p2p_exchange(sends, recvs, group)
    return received[0] if recvs else platform.zeros_like(template)


def _halo_forward(ctx, tail, group):
    prev, nxt = _neighbours(group)
    ctx.prev, ctx.nxt, ctx.group = prev, nxt, group
    return _exchange(tail, nxt, tail, prev, group)


def _halo_backward(ctx, grad):
    # the reverse exchange: the halo's gradient returns to the rank whose tail it was
    grad = grad.contiguous()
    return _exchange(grad, ctx.prev, grad, ctx.nxt, ctx.group), None


_HALO = lazy_autograd_function("ConvHaloExchange", _halo_forward, _halo_backward)


def previous_tokens(x: Any, count: Any, group: Any) -> Any:
    """The ``count`` tokens (last dim) before this rank's block ``x``: the previous rank's last
    ``count`` (zeros on the first rank); differentiable (its gradient reaches that rank's ``x``)."""
    return _HALO(x[..., x.shape[-1] - count:].contiguous(), cp_group(group))


def context_parallel_causal_conv1d(x: Any, weight: Any, bias: Any, group: Any) -> Any:
    """This rank's block of a depthwise causal conv1d (F.conv1d with groups=channels and K − 1 left
    padding, cropped to the sequence): x (batch, channels, t_local), weight (channels, K), bias
    (channels,) or None. Activation is the caller's."""
    kernel = weight.shape[-1]
    length = x.shape[-1]
    agree_conv(group, x, weight, bias)   # ranks alike first: check_conv reads this rank's block length
    check_conv(x, weight, kernel, length)
    if kernel > 1:
        x = get_platform().cat([previous_tokens(x, kernel - 1, group), x.to(weight.dtype)], dim=-1)
    x = x.to(weight.dtype)
    out = None
    for tap in range(kernel):   # cross-correlation: tap k reads the token K − 1 − k before
        term = weight[:, tap].unsqueeze(-1) * x[..., tap:tap + length]
        out = term if out is None else out + term
    return out if bias is None else out + bias.unsqueeze(-1)
