"""Context parallelism for attention: Ulysses, all-gather KV, their hybrid, head-tail load balancing,
ring attention, and packed-document / padding masks in all of them."""
from hyper_parallel.core.context_parallel.attention_function import attention
from hyper_parallel.core.context_parallel.masks.attention_masks import attention_masks
from hyper_parallel.core.context_parallel.style import AsyncContextParallel, ContextParallel, start_attention

__all__ = ["AsyncContextParallel", "ContextParallel", "attention", "attention_masks", "start_attention"]
