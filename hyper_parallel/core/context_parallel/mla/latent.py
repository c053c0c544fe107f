"""A sequence-split tensor gathered whole on every CP rank, for MLA's compressed latent.

Under all-gather KV an MLA layer need not gather per-head K and V (H·(d_qk + d_v) values a token):
they are one up-projection (kv_b_proj) away from the compressed latent c_kv and the shared rope
key (kv_lora_rank + rope_dim values a token). So the latent travels and every rank up-projects the
whole sequence itself. ``gather_sequence`` is that move: one all-gather of this rank's block into
global token order (rank r's block at [r·L, (r+1)·L), the order all-gather KV gives K/V, with or
without load balance: the head-tail exchange moves queries only). Its backward is the all-gather's
adjoint, one reduce-scatter: each rank's gradient for the gathered tensor is the share of its own
queries, and the sum over ranks of the slices of this rank's block is the exact gradient.

This is the collective KVAllGather runs (``differentiable_all_gather``); KVAllGather itself stacks
tensors of one shape as DTensors, while c_kv and the rope key differ in their last dim and are
up-projected as plain tensors, so they are joined on that dim and gathered once here.
"""
from typing import Any
from hyper_parallel.platform import get_platform


def gather_sequence(local: Any, mesh: Any, seq_dim: Any) -> Any:
    """``local`` (this rank's contiguous block on ``seq_dim``) gathered over the 1-D CP ``mesh``
    into the whole sequence, differentiably (backward: reduce-scatter of the gradient)."""
    if mesh.ndim != 1:
        raise ValueError(f"gather_sequence: needs the 1-D CP mesh, got {mesh.ndim}-D {mesh.mesh_dim_names}")
    return get_platform().differentiable_all_gather(local.contiguous(), mesh.get_group(), seq_dim)


def gather_sequence_no_grad(local: Any, mesh: Any, seq_dim: Any) -> Any:
    """The same gather for a tensor without gradient (DSA's indexer key): no backward collective."""
    platform = get_platform()
    return platform.all_gather(platform.detach(local).contiguous(), mesh.get_group(), dim=seq_dim)


def gather_latents(latents: Any, mesh: Any, seq_dim: Any) -> Any:
    """Tensors of one shape but their last dim (c_kv, the rope key), gathered in one collective:
    joined on the last dim, gathered, split again."""
    widths = [t.shape[-1] for t in latents]
    whole = gather_sequence(get_platform().cat(list(latents), -1), mesh, seq_dim)
    out, start = [], 0
    for width in widths:
        out.append(whole.narrow(whole.ndim - 1, start, width))
        start += width
    return out


def latent_gather_bytes(batch: Any, seq: Any, cp: Any, kv_lora_rank: Any, rope_dim: Any, itemsize: Any,
                        index_dim: int = 0) -> Any:
    """Bytes one rank sends in the forward of one MLA layer on the latent path (the backward's
    reduce-scatter sends the same again, less the indexer key, which has no gradient):
    (P−1)/P · B·S·(kv_lora_rank + rope_dim [+ DSA's indexer head dim]) elements."""
    return (cp - 1) * batch * (seq // cp) * (kv_lora_rank + rope_dim + index_dim) * itemsize


def per_head_gather_bytes(batch: Any, seq: Any, cp: Any, heads: Any, qk_head_dim: Any, v_head_dim: Any,
                          itemsize: Any) -> Any:
    """Bytes one rank sends in the forward of all-gather KV on the up-projected K and V:
    (P−1)/P · B·S·H·(d_qk + d_v) elements."""
    return (cp - 1) * batch * (seq // cp) * heads * (qk_head_dim + v_head_dim) * itemsize


def latent_ratio(heads: Any, qk_head_dim: Any, v_head_dim: Any, kv_lora_rank: Any, rope_dim: Any) -> Any:
    """How many times fewer bytes the latent travels in than per-head K/V: H·(d_qk + d_v) / (r + d_rope)."""
    return heads * (qk_head_dim + v_head_dim) / (kv_lora_rank + rope_dim)
