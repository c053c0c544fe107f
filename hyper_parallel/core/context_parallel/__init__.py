"""Context parallelism for attention: Ulysses, all-gather KV, their hybrid, head-tail load balancing,
and ring attention."""
from hyper_parallel.core.context_parallel.style import ContextParallel

__all__ = ["ContextParallel"]
