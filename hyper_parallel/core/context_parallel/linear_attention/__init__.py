"""Linear attention under context parallelism: the gated delta rule (Gated DeltaNet, Kimi Delta
Attention) and its short causal convolution on sequence blocks, exact (SPEC §13).

A user's own layer calls ``delta_rule`` / ``causal_conv1d`` and is parallelized with
``LinearAttentionContextParallel``; ``context_parallel_delta_rule`` /
``context_parallel_causal_conv1d`` take the CP group explicitly."""
from hyper_parallel.core.context_parallel.linear_attention.chunk_rule import chunk_delta_rule
from hyper_parallel.core.context_parallel.linear_attention.conv_halo import context_parallel_causal_conv1d
from hyper_parallel.core.context_parallel.linear_attention.delta_rule import context_parallel_delta_rule
from hyper_parallel.core.context_parallel.linear_attention.functional import causal_conv1d, delta_rule
from hyper_parallel.core.context_parallel.linear_attention.style import LinearAttentionContextParallel

__all__ = ["LinearAttentionContextParallel", "causal_conv1d", "chunk_delta_rule",
           "context_parallel_causal_conv1d", "context_parallel_delta_rule", "delta_rule"]
