"""Attention of a block of queries on a block of keys under document / padding / causal masks,
tile by tile (block_masks.py): the kernel every masked ContextParallel mode runs locally.

q covers global positions ``q_span`` and k/v ``k_span`` of batch rows ``rows``; tensors are
(batch, heads, seq, dim), k/v may have fewer heads (GQA). Each query tile merges its key tiles by
log-sum-exp; skipped tiles cost nothing. ``forward`` returns (out, lse) with lse = -inf and out = 0
on rows that see no key, so blocks from other ranks (ring steps) merge in safely; ``backward``
recomputes each tile's gradients from the final (out, lse) of its rows.
"""
from typing import Any
from hyper_parallel.core.autograd_functions import lazy_autograd_function
from hyper_parallel.core.attention.block_masks import Span, spans, tile_kind, tile_mask
from hyper_parallel.core.attention.offset_causal import expand_heads, fold_heads
from hyper_parallel.core.attention.lse import fold_sinks, merge, sinks_grad
from hyper_parallel.platform import get_platform

NEG_INF = float("-inf")
SEQ = 2


def _key_tiles(q_tiles, k_span, size):
    """One partition of ``k_span`` for every query tile, cut at the query tiles' edges as well: the
    causal diagonal of each query tile is then one aligned key tile, the keys before it whole
    (unmasked) tiles, and per-tile gradients add up on a common partition."""
    inner = {c for q in q_tiles for c in (q.start, q.stop) if k_span.start < c < k_span.stop}
    cuts = sorted({k_span.start, k_span.stop} | inner)
    out = []
    for a, b in zip(cuts, cuts[1:]):
        out += spans(Span(a, b - a), size)
    return out


def plan(masks: Any, rows: Any, q_span: Any, k_span: Any, causal: Any, window: Any = None) -> Any:
    """[(query tile, [(key tile, kind)])], skipped key tiles left out. Only the kinds are kept (a few
    bytes per tile): a ``masked`` tile's mask is rebuilt from the ids where it is used, so a call holds
    one tile's mask at a time, not every partial tile's (O(B·S·block) over a Ulysses rank's S)."""
    size = masks.block_size
    q_tiles = spans(q_span, size)
    k_tiles = _key_tiles(q_tiles, k_span, size)
    result = []
    for q in q_tiles:
        keys = []
        for k in k_tiles:
            kind = tile_kind(masks, rows, q, k, causal, window)
            if kind != "skip":
                keys.append((k, kind))
        result.append((q, keys))
    return result


def _narrow(t, span, origin):
    return t.narrow(SEQ, span.start - origin.start, span.length)


def _on(mask, like):
    return mask if mask.device == like.device else mask.to(like.device)


def _lse_dtype(q):
    ref = q.new_zeros((1,))
    return ref.double().dtype if q.dtype == ref.double().dtype else ref.float().dtype


def forward(q: Any, k: Any, v: Any, masks: Any, rows: Any, q_span: Any, k_span: Any, causal: Any, scale: Any,
            softcap: Any = None, window: Any = None) -> Any:
    """(out in float32/64, lse) of q's rows over k/v's keys; None when the masks leave no key
    visible to any row (nothing was computed). ``softcap``: scores soft-capped (the block kernels');
    ``window``: the sliding window on top of ``causal`` (block_masks.py)."""
    platform = get_platform()
    groups = q.shape[-3] // k.shape[-3]
    outs, lses = [], []
    tiles = plan(masks, rows, q_span, k_span, causal, window)
    if not any(keys for _, keys in tiles):
        return None
    for q_tile, keys in tiles:
        qt, acc = _narrow(q, q_tile, q_span), None
        for k_tile, kind in keys:
            kt, vt = (expand_heads(_narrow(t, k_tile, k_span), groups) for t in (k, v))
            if kind == "masked":
                mask = _on(tile_mask(masks, rows, q_tile, k_tile, causal, window), q)
                out, lse = platform.attention_block_forward(qt, kt, vt, False, scale, mask=mask,
                                                            softcap=softcap)
                empty = ~mask.any(-1)   # (nb, 1, ql): the kernel's lse for such rows is not -inf
                lse = lse.masked_fill(empty, NEG_INF)
                out = out.masked_fill(empty.unsqueeze(-1), 0.0)
            else:
                out, lse = platform.attention_block_forward(qt, kt, vt, kind == "causal", scale,
                                                            softcap=softcap)
            acc = merge(acc, out, lse)
        if acc is None:
            acc = empty_result(qt, v)
        outs.append(acc[0])
        lses.append(acc[1])
    cat = get_platform().cat
    return (outs[0], lses[0]) if len(outs) == 1 else (cat(outs, SEQ), cat(lses, SEQ))


def backward(grad_out: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, masks: Any, rows: Any, q_span: Any,
             k_span: Any, causal: Any, scale: Any, softcap: Any = None, window: Any = None) -> Any:
    """(dq, dk, dv) in the accumulation dtype (lse's) for one q block against one k/v block; None
    when the masks leave no key visible to any row."""
    platform = get_platform()
    groups = q.shape[-3] // k.shape[-3]
    acc = lse.dtype
    tiles = plan(masks, rows, q_span, k_span, causal, window)
    if not any(keys for _, keys in tiles):
        return None
    live_lse = lse.masked_fill(lse == NEG_INF, 0.0)   # rows seeing nothing: every score is masked anyway
    dq: list[Any] = []
    dk: dict[Any, Any] = {}
    dv: dict[Any, Any] = {}
    for q_tile, keys in tiles:
        qt, gt, ot = (_narrow(t, q_tile, q_span) for t in (q, grad_out, out))
        lt = live_lse.narrow(SEQ, q_tile.start - q_span.start, q_tile.length)
        dqt = qt.new_zeros(tuple(qt.shape), dtype=acc)
        for k_tile, kind in keys:
            kt, vt = (expand_heads(_narrow(t, k_tile, k_span), groups) for t in (k, v))
            extra = {"softcap": softcap} if softcap else {}
            if kind == "masked":
                extra["mask"] = _on(tile_mask(masks, rows, q_tile, k_tile, causal, window), q)
            dqb, dkb, dvb = platform.attention_block_backward(gt, qt, kt, vt, ot, lt, kind == "causal",
                                                              scale, **extra)
            dqt = dqt + dqb
            key = (k_tile.start, k_tile.length)
            dk[key] = fold_heads(dkb, groups).to(acc) + dk.get(key, 0)
            dv[key] = fold_heads(dvb, groups).to(acc) + dv.get(key, 0)
        dq.append(dqt)
    dk_full, dv_full = (_assemble(parts, like, k_span, acc) for parts, like in ((dk, k), (dv, v)))
    return (dq[0] if len(dq) == 1 else platform.cat(dq, SEQ)), dk_full, dv_full


def _assemble(parts, like, span, dtype):
    """The (batch, kv heads, span, dim) gradient from per-tile pieces, zeros where no tile was live."""
    platform = get_platform()
    pieces, at = [], span.start
    for start, length in sorted(parts):
        if start > at:
            pieces.append(_zeros(like, start - at, dtype))
        pieces.append(parts[(start, length)])
        at = start + length
    if at < span.stop:
        pieces.append(_zeros(like, span.stop - at, dtype))
    return pieces[0] if len(pieces) == 1 else platform.cat(pieces, SEQ)


def _zeros(like, length, dtype):
    shape = list(like.shape)
    shape[SEQ] = length
    return like.new_zeros(tuple(shape), dtype=dtype)


def empty_result(q: Any, v: Any) -> Any:
    """(out, lse) of rows that see no key: 0 and -inf (torch's SDPA gives 0 for a fully masked row)."""
    shape = tuple(q.shape[:-1])
    dtype = _lse_dtype(q)
    # new_zeros + masked_fill, not new_full: MindSpore's new_full is Ascend-only
    lse = q.new_zeros(shape, dtype=dtype)
    return q.new_zeros(shape + (v.shape[-1],), dtype=dtype), lse.masked_fill(lse == 0, NEG_INF)


def _autograd_forward(ctx, q, k, v, sinks, masks, rows, q_span, k_span, causal, scale, softcap, window):
    out, lse = forward(q, k, v, masks, rows, q_span, k_span, causal, scale, softcap, window) or \
        empty_result(q, v)
    if sinks is not None:   # the sink logits join the denominator once, after every tile (lse.py)
        out, lse = fold_sinks(out, lse, sinks)
    out = out.to(q.dtype)
    ctx.save_for_backward(q, k, v, out, lse, *(() if sinks is None else (sinks,)))
    ctx.args = (masks, rows, q_span, k_span, causal, scale, softcap, window)
    return out


def _autograd_backward(ctx, grad_out):
    q, k, v, out, lse, *sinks = ctx.saved_tensors
    grad_out = grad_out.contiguous()
    grads = backward(grad_out, q, k, v, out, lse, *ctx.args)
    if grads is None:
        grads = (q.new_zeros(q.shape), k.new_zeros(k.shape), v.new_zeros(v.shape))
    dq, dk, dv = grads
    dsinks = sinks_grad(grad_out, out, lse, sinks[0]) if sinks else None
    return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dsinks) + (None,) * 8


_MASKED_ATTENTION = lazy_autograd_function("MaskedBlockAttention", _autograd_forward, _autograd_backward)


def masked_attention(q: Any, k: Any, v: Any, masks: Any, rows: Any, q_span: Any, k_span: Any, causal: Any,
                     scale: Any, softcap: Any = None, sinks: Any = None, window: Any = None) -> Any:
    """Differentiable masked attention of q (rows ``q_span``) on k/v (keys ``k_span``); ``softcap``
    ``sinks`` (one logit per head of q) and ``window`` as ``hyper_parallel.attention``'s."""
    return _MASKED_ATTENTION(q, k, v, sinks, masks, rows, q_span, k_span, causal, scale, softcap, window)


__all__ = ["forward", "backward", "masked_attention", "merge", "plan"]
