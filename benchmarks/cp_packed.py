"""``--packed N``: every mode runs on packed sequences (N documents per batch row).

The document lengths are drawn once from a seed (every rank and the reference see the same ids);
each ContextParallel mode runs under ``attention_masks(document_ids=...)`` (the tiled masked
kernels, skipping the tiles a document boundary empties), and the single-device reference is SDPA
with the equivalent dense (B, 1, S, S) mask. Torch only; raw (hand-written collective) modes and
peers have no packed path and are skipped.
"""
import numpy as np

from benchmarks.cp_frameworks import UnsupportedConfig


def document_ids(cfg):
    """(B, S) int64 ids: N documents per row with seeded random lengths (every length >= 1)."""
    rng = np.random.RandomState(1)
    rows = []
    for _ in range(cfg.batch):
        cuts = np.sort(rng.choice(np.arange(1, cfg.seq), size=cfg.packed - 1, replace=False))
        ids = np.zeros(cfg.seq, dtype=np.int64)
        ids[cuts] = 1
        rows.append(np.cumsum(ids))
    return np.stack(rows)


def _torch(fw):
    if fw.name != "torch":
        raise UnsupportedConfig(f"--packed runs on torch only (attention_masks is tested there); platform "
                                f"is {fw.name}")
    import torch
    return torch


def reference(cfg, fw):
    """The single-device callable: SDPA with the dense document (and causal) mask."""
    torch = _torch(fw)
    ids = torch.from_numpy(document_ids(cfg)).to(fw.device)
    allowed = ids.unsqueeze(-1) == ids.unsqueeze(-2)
    if cfg.causal:
        allowed &= torch.ones(cfg.seq, cfg.seq, dtype=torch.bool, device=fw.device).tril()
    mask = allowed.unsqueeze(1)
    gqa = cfg.kv_heads != cfg.heads
    return lambda q, k, v: fw.sdpa(q, k, v, cfg.causal, gqa, mask=mask)


def packed(attn, cfg, fw):
    """``attn`` (a ContextParallel module) called under the packed documents' masks."""
    torch = _torch(fw)
    from hyper_parallel import attention_masks
    ids = torch.from_numpy(document_ids(cfg))   # on the CPU: tile decisions never sync a device

    def call(*inputs):
        with attention_masks(document_ids=ids, block_size=cfg.packed_block):
            return attn(*inputs)
    return call


def skip_reason(cfg, mode):
    """Why ``mode`` has no packed row (None: it has one)."""
    if getattr(mode, "raw", False) or not hasattr(mode, "raw"):
        return "no packed-sequence path (hand-written collectives / peer implementation)"
    return None
