"""DeepSeek Sparse Attention (DSA, DeepSeek-V3.2) under all-gather KV: the top-k over global keys.

DSA's indexer scores every (query, key) pair, keeps the k best keys of each query among the keys
it may see (invisible keys scored -inf, k capped at the key count), and the attention then attends
those only. Split naively over the sequence, each rank
would pick its top-k among its own block's keys: another model. Here the indexer key is gathered
(latent.py) and each local query row ranks the whole sequence under its global visibility
(causal by global position, padding, packed documents), so every row selects exactly the keys it
selects on one device. The attention is then dense over the gathered K/V with the boolean mask
visible ∧ selected, as transformers' eager/sdpa path does on one device: each rank computes its
L rows against all S keys, the same work on every rank (so load balancing has nothing to move).
"""
from typing import Any
from hyper_parallel.platform import get_platform


def visible_keys(batch: Any, row_start: Any, rows: Any, total: Any, masks: Any = None,
                 device: Any = None) -> Any:
    """Boolean (batch, rows, total): query row_start + i may see key j (causal by global position,
    and ``masks``, the AttentionMasks of the global sequence: padding, packed documents)."""
    platform = get_platform()
    positions = platform.arange(total, device=device)
    row_ids = positions.narrow(0, row_start, rows)
    allowed = (positions.reshape((1, total)) <= row_ids.reshape((rows, 1))).reshape((1, rows, total))
    allowed = allowed.expand(batch, rows, total)
    padding = None if masks is None else masks.padding
    documents = None if masks is None else masks.document_ids
    if padding is not None:   # a padded key is seen by no query
        allowed = allowed & padding.to(device=device).bool().reshape((batch, 1, total))
    if documents is not None:
        ids = documents.to(device=device)
        allowed = allowed & (ids.narrow(1, row_start, rows).unsqueeze(-1) == ids.unsqueeze(1))
    return allowed


def selected_keys(indices: Any, total: Any) -> Any:
    """Boolean (B, L, ``total``): True at the keys ``indices`` (B, L, k) name, the top-k each query
    row chose over the global keys."""
    shape = tuple(indices.shape[:-1]) + (total,)
    return indices.new_zeros(shape).bool().scatter(-1, indices.long(), True)


def sparse_attention(q: Any, k: Any, v: Any, allowed: Any, selected: Any, scale: Any) -> Any:
    """Attention of local rows ``q`` (B, H, L, D) over the gathered ``k``, ``v`` (B, H, S, D) on the
    keys both ``allowed`` and ``selected`` (B, L, S); output (B, H, L, Dv)."""
    mask = (allowed & selected).unsqueeze(1)
    return get_platform().sdpa(q, k, v, attn_mask=mask, scale=scale)
