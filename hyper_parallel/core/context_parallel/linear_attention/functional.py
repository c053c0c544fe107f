"""``delta_rule`` and ``causal_conv1d``: what a user's linear-attention module calls.

Written as single-device code, they run on the whole sequence; inside the forward of a module that
``LinearAttentionContextParallel`` parallelized (style.py), the same calls run on this rank's block
with the exact incoming state and the convolution's halo, over that module's CP group. The module
needs no other change: everything else in a GDN / KDA layer is token-local.
"""
from typing import Any

from hyper_parallel.core.arguments import check_delta_rule_numbers
from hyper_parallel.core.context_parallel.linear_attention.chunk_rule import chunk_delta_rule
from hyper_parallel.core.context_parallel.linear_attention.conv_halo import context_parallel_causal_conv1d
from hyper_parallel.core.context_parallel.linear_attention.checks import active, agree_delta_rule
from hyper_parallel.core.context_parallel.linear_attention.delta_rule import (
    context_parallel_delta_rule, cp_group)
from hyper_parallel.platform import get_platform


def delta_rule(q: Any, k: Any, v: Any, g: Any, beta: Any, initial_state: Any = None, chunk_size: int = 64,
               use_qk_l2norm: bool = True, scale: Any = None) -> Any:
    """The gated delta rule's output (b, t, h_v, d_v): q, k (b, t, h_k, d_k); v (b, t, h_v, d_v);
    g (b, t, h_v) log-decay per head (GDN) or (b, t, h_v, d_k) per channel (KDA); beta (b, t, h_v).
    Under ``LinearAttentionContextParallel``: this rank's block, exact."""
    cp = active()
    if cp is not None:   # ranks alike first: a rank refusing its own numbers alone would strand its peers
        agree_delta_rule(cp_group(cp[0]), q, k, v, g, beta, cp[1], chunk_size, initial_state, use_qk_l2norm,
                         scale)
    check_delta_rule_numbers(chunk_size, scale)
    if cp is None:
        return chunk_delta_rule(q, k, v, g, beta, initial_state, chunk_size, use_qk_l2norm, scale)[0]
    return context_parallel_delta_rule(q, k, v, g, beta, cp[0], mode=cp[1], initial_state=initial_state,
                                       chunk_size=chunk_size, use_qk_l2norm=use_qk_l2norm, scale=scale)


def causal_conv1d(x: Any, weight: Any, bias: Any = None) -> Any:
    """Depthwise causal convolution: x (b, channels, t), weight (channels, kernel), bias (channels,)
    or None; output (b, channels, t). Under ``LinearAttentionContextParallel``: this rank's block."""
    cp = active()
    if cp is not None:
        return context_parallel_causal_conv1d(x, weight, bias, cp[0])
    kernel, length = weight.shape[-1], x.shape[-1]
    if kernel > 1:   # the zero history before the first token
        pad = get_platform().zeros(x.shape[:-1] + (kernel - 1,), dtype=x.dtype, device=x.device)
        x = get_platform().cat([pad, x], dim=-1)
    out = None
    for tap in range(kernel):
        term = weight[:, tap].unsqueeze(-1) * x[..., tap:tap + length]
        out = term if out is None else out + term
    return out if bias is None else out + bias.unsqueeze(-1)
