"""Attention of a block of queries on the whole key sequence with the variants sdpa has no argument
for: logit soft-capping, a sliding window, attention sinks (``Variant`` and the sinks tensor).

It runs where the keys are whole on the rank: a single device, Ulysses (heads split), all-gather KV
(query rows [q_start, q_start + L) of the global sequence, with or without the head-tail split).
The keys are cut into blocks (core/attention/band.py: the keys before the queries, then the diagonal;
with a window, the keys no query sees are a block of their own) and each block that is not skipped
runs the platform's block kernel, merged by log-sum-exp; the sinks are folded in last
(core/attention/lse.py). Backward recomputes each block's gradients from the saved (out, lse).
Tensors are (batch, heads, seq, dim); k/v may have fewer heads (GQA), ``sinks`` is one logit per
query head held here.
"""
from typing import Any, Optional
from dataclasses import dataclass

from hyper_parallel.core.autograd_functions import lazy_autograd_function
from hyper_parallel.core.attention.offset_causal import expand_heads, fold_heads
from hyper_parallel.core.attention.band import band_mask, key_cuts, relation
from hyper_parallel.core.attention.lse import NEG_INF, clear_empty_rows, fold_sinks, merge, sinks_grad
from hyper_parallel.platform import get_platform

SEQ = 2


@dataclass(frozen=True)
class Variant:
    """What one attention call computes, besides q, k, v and the sinks."""
    causal: bool = False
    scale: Optional[float] = None
    softcap: Optional[float] = None   # c: scores -> c·tanh(s / c) before masking and softmax
    window: Optional[int] = None      # keys j with i - window < j <= i (needs causal)


def _blocks(q, k, q_start, variant):
    """(key start, length, causal flag, mask or None) of every key block some query row sees."""
    rows, cuts = q.shape[SEQ], key_cuts(q_start, q.shape[SEQ], k.shape[SEQ], variant.window)
    for start, stop in zip(cuts, cuts[1:]):
        kind = relation(q_start, rows, start, stop - start, variant.causal, variant.window)
        if kind == "skip":
            continue
        mask = None
        if kind == "mask":
            mask = band_mask(q_start, rows, start, stop - start, variant.causal, variant.window, q.device)
        yield start, stop - start, kind == "diag", mask


def _kv_block(t, start, length, groups):
    return expand_heads(t.narrow(SEQ, start, length), groups)


def _nothing_seen(q, v):
    """(out, lse) of rows that see no key: 0 and -inf, in the log-sum-exp dtype (float32 / float64)."""
    ref = q.new_zeros((1,))
    dtype = ref.double().dtype if q.dtype == ref.double().dtype else ref.float().dtype
    lse = q.new_zeros(tuple(q.shape[:-1]), dtype=dtype)
    return q.new_zeros(tuple(q.shape[:-1]) + (v.shape[-1],), dtype=dtype), lse.masked_fill(lse == 0, NEG_INF)


def _forward(ctx, q, k, v, sinks, q_start, variant):
    platform = get_platform()
    groups, acc = q.shape[-3] // k.shape[-3], None
    for start, length, diag, mask in _blocks(q, k, q_start, variant):
        kb, vb = _kv_block(k, start, length, groups), _kv_block(v, start, length, groups)
        out, lse = platform.attention_block_forward(q, kb, vb, diag, variant.scale, mask=mask,
                                                    softcap=variant.softcap)
        if mask is not None:
            out, lse = clear_empty_rows(out, lse, mask)
        acc = merge(acc, out, lse)
    out, lse = acc if acc is not None else _nothing_seen(q, v)
    if sinks is not None:
        out, lse = fold_sinks(out, lse, sinks)
    out = out.to(q.dtype)
    ctx.save_for_backward(q, k, v, out, lse, *(() if sinks is None else (sinks,)))
    ctx.q_start, ctx.variant = q_start, variant
    return out


def _backward(ctx, grad_out):
    platform = get_platform()
    q, k, v, out, lse, *rest = ctx.saved_tensors
    variant, groups = ctx.variant, q.shape[-3] // k.shape[-3]
    grad_out = grad_out.contiguous()
    live = lse.masked_fill(lse == NEG_INF, 0.0)   # a row that saw nothing: all its scores are masked
    dq, dk, dv = q.new_zeros(q.shape, dtype=lse.dtype), [], []
    at = 0
    for start, length, diag, mask in _blocks(q, k, ctx.q_start, variant):
        if start > at:   # keys no row sees: zero gradient
            dk.append(k.new_zeros(_seq_shape(k, start - at), dtype=lse.dtype))
            dv.append(v.new_zeros(_seq_shape(v, start - at), dtype=lse.dtype))
        kb, vb = _kv_block(k, start, length, groups), _kv_block(v, start, length, groups)
        dqb, dkb, dvb = platform.attention_block_backward(grad_out, q, kb, vb, out, live, diag, variant.scale,
                                                          mask=mask, softcap=variant.softcap)
        dq = dq + dqb
        dk.append(fold_heads(dkb, groups).to(lse.dtype))
        dv.append(fold_heads(dvb, groups).to(lse.dtype))
        at = start + length
    if at < k.shape[SEQ]:
        dk.append(k.new_zeros(_seq_shape(k, k.shape[SEQ] - at), dtype=lse.dtype))
        dv.append(v.new_zeros(_seq_shape(v, v.shape[SEQ] - at), dtype=lse.dtype))
    dk, dv = (parts[0] if len(parts) == 1 else platform.cat(parts, SEQ) for parts in (dk, dv))
    dsinks = sinks_grad(grad_out, out, lse, rest[0]) if rest else None
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dsinks, None, None


def _seq_shape(t, length):
    shape = list(t.shape)
    shape[SEQ] = length
    return tuple(shape)


_VARIANT_ATTENTION = lazy_autograd_function("VariantAttention", _forward, _backward)


def variant_attention(q: Any, k: Any, v: Any, sinks: Any, q_start: Any, variant: Any) -> Any:
    """Differentiable attention of q (global rows [q_start, +L)) on the whole k/v under ``variant``,
    with ``sinks`` (one logit per head of q, or None) in the denominator."""
    return _VARIANT_ATTENTION(q, k, v, sinks, q_start, variant)


__all__ = ["Variant", "variant_attention"]
