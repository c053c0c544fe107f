"""Multi-head latent attention (MLA: DeepSeek-V3, V3.2) under all-gather KV: the compressed latent
travels instead of per-head K/V (latent.py), the attention runs on the gathered sequence
(attend.py), and DeepSeek Sparse Attention takes its top-k over the global keys (sparse.py)."""
from hyper_parallel.core.context_parallel.mla.attend import attend_gathered
from hyper_parallel.core.context_parallel.mla.latent import (gather_latents, gather_sequence,
                                                             gather_sequence_no_grad, latent_gather_bytes,
                                                             latent_ratio, per_head_gather_bytes)
from hyper_parallel.core.context_parallel.mla.sparse import selected_keys, sparse_attention, visible_keys

__all__ = ["attend_gathered", "gather_latents", "gather_sequence", "gather_sequence_no_grad",
           "latent_gather_bytes", "latent_ratio", "per_head_gather_bytes", "selected_keys",
           "sparse_attention", "visible_keys"]
