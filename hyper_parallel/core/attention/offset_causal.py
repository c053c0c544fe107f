"""The all-gather-KV attention kernel: L local query rows [r0, r0 + L) on the whole keys under the
global causal mask (the sdpa rule, core/dtensor/ops/attention.py, picks it when q is split on the
sequence and k, v are replicated).

Keys past r0 + L are dropped before the kernel runs; the visible keys are attended in two blocks
merged by their log-sum-exp (lse.py ``merge_blocks``): [0, r0), seen by every local row, and the
diagonal block [r0, r0 + L) under the kernel's own causal mask. No row's scores include a key it may
not see, so a NaN or inf in an excluded key stays out of that row exactly as in single-device causal
attention. Also the GQA head helpers every block kernel shares (``expand_heads``, ``fold_heads``).
"""
from typing import Any

from hyper_parallel.core.attention.lse import merge_blocks
from hyper_parallel.core.autograd_functions import lazy_autograd_function
from hyper_parallel.platform import get_platform

# F.scaled_dot_product_attention's arguments by position
ARG_NAMES = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")


def _as_4d(attend, q, k, v):
    """Run ``attend`` on (batch, heads, seq, dim) views: the block kernels take exactly 4 dims, sdpa
    takes (seq, dim) with any leading dims (none, one, several)."""
    if q.ndim == 4:
        return attend(q, k, v)

    def four(t):
        return t.reshape((-1, t.shape[-3] if t.ndim > 2 else 1) + tuple(t.shape[-2:]))
    out = attend(four(q), four(k), four(v))
    return out.reshape(tuple(q.shape[:-1]) + (out.shape[-1],))


def offset_causal(row_start):
    """Local attention of query rows [row_start, row_start + L) under the global causal mask."""
    def offset_causal_attention(call, args, kwargs):
        values = {name: (args[i] if i < len(args) else kwargs.get(name)) for i, name in enumerate(ARG_NAMES)}
        q, k, v = values["query"], values["key"], values["value"]
        seq = q.ndim - 2
        rows = q.shape[seq]
        visible = max(0, min(row_start + rows, k.shape[seq]))
        k, v = k.narrow(seq, 0, visible), v.narrow(seq, 0, visible)
        platform = get_platform()
        gqa = bool(kwargs.get("enable_gqa"))
        extra = {"enable_gqa": True} if gqa else {}
        dropout = values["dropout_p"] or 0.0
        if row_start == 0 and visible == rows:
            return platform.sdpa(q, k, v, dropout_p=dropout, is_causal=True, scale=values["scale"], **extra)
        if dropout == 0 and rows and visible and (gqa or q.ndim < 3 or q.shape[-3] == k.shape[-3]):
            return _as_4d(lambda q4, k4, v4: _offset_attention(q4, k4, v4, min(row_start, visible),
                                                               values["scale"]), q, k, v)
        # dropout has no log-sum-exp kernel: a boolean mask (NaN isolation not guaranteed here)
        cols = platform.arange(visible, device=q.device)
        row_ids = platform.arange(rows, device=q.device) + row_start
        mask = cols.unsqueeze(0) <= row_ids.unsqueeze(1)
        return platform.sdpa(q, k, v, attn_mask=mask, dropout_p=dropout, scale=values["scale"], **extra)
    return offset_causal_attention


def expand_heads(t: Any, groups: Any) -> Any:
    return t if groups == 1 else t.repeat_interleave(groups, dim=-3)


def fold_heads(t: Any, groups: Any) -> Any:
    """Sum the gradients of the query heads that share one k/v head (GQA)."""
    if groups == 1:
        return t
    shape = tuple(t.shape)
    return t.reshape(shape[:-3] + (shape[-3] // groups, groups) + shape[-2:]).sum(-3)


def _pieces(k, prefix):
    """(key block, causal) pairs: [0, prefix) seen by every row, then the diagonal block."""
    total = k.shape[k.ndim - 2]
    blocks = [(0, prefix, False), (prefix, total - prefix, True)]
    return [(start, length, causal) for start, length, causal in blocks if length]


def _offset_forward(ctx, q, k, v, prefix, scale):
    platform = get_platform()
    groups, seq = q.shape[-3] // k.shape[-3], k.ndim - 2
    acc = None
    for start, length, causal in _pieces(k, prefix):
        kb, vb = (expand_heads(t.narrow(seq, start, length), groups) for t in (k, v))
        acc = merge_blocks(acc, *platform.attention_block_forward(q, kb, vb, causal, scale))
    out = acc[0].to(q.dtype)
    ctx.save_for_backward(q, k, v, out, acc[1])
    ctx.prefix, ctx.scale = prefix, scale
    return out


def _offset_backward(ctx, grad_out):
    platform = get_platform()
    q, k, v, out, lse = ctx.saved_tensors
    groups, seq = q.shape[-3] // k.shape[-3], k.ndim - 2
    grad_out = grad_out.contiguous()
    dq, dks, dvs = None, [], []
    for start, length, causal in _pieces(k, ctx.prefix):
        kb, vb = (expand_heads(t.narrow(seq, start, length), groups) for t in (k, v))
        dqb, dkb, dvb = platform.attention_block_backward(grad_out, q, kb, vb, out, lse, causal, ctx.scale)
        dq = dqb if dq is None else dq + dqb
        dks.append(fold_heads(dkb, groups))
        dvs.append(fold_heads(dvb, groups))
    dk, dv = (parts[0] if len(parts) == 1 else platform.cat(parts, seq) for parts in (dks, dvs))
    return dq, dk.to(k.dtype), dv.to(v.dtype), None, None


def _offset_attention(q, k, v, prefix, scale):
    """Causal attention of L query rows on keys [0, prefix + L'): row i sees keys j <= prefix + i."""
    return _OFFSET_ATTENTION(q, k, v, prefix, scale)


_OFFSET_ATTENTION = lazy_autograd_function("OffsetCausalAttention", _offset_forward, _offset_backward)
