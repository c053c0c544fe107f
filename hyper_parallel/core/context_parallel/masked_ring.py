"""Ring attention under ``attention_masks`` (packed documents, padding, with or without causal).

The ring is ring.py's (same layout, same neighbours, K/V blocks one hop per step, dK/dV travelling
with their blocks, P-1 hops and the last one home), but each (local q chunk, visiting k chunk)
pair runs the masked tile kernel (masked_attention.py) with the pair's global positions: the tile
masks come from the document ids / padding of the q chunk and the visiting k chunk, and a pair or
tile that a document boundary, padding or the causal diagonal empties is skipped without compute.
With zigzag (load balancing) each rank holds chunks 2r and 2P-1-2r, and the positions follow them.
"""
from hyper_parallel.core.context_parallel import masked_attention as kernel
from hyper_parallel.core.context_parallel.block_masks import Span
from hyper_parallel.core.context_parallel.ring import _Ring
from hyper_parallel.platform import get_platform

SEQ = 2


def _chunks(layout, position, length):
    """Global spans of the chunks held at ring ``position``; each rank's block is ``length`` long."""
    ids = layout.chunk_ids(position)
    size = length // len(ids)
    return [Span(i * size, size) for i in ids]


def _forward(ctx, q, k, v, layout, masks, causal, scale):
    ring, length = _Ring(layout), q.shape[SEQ]
    rows = Span(0, q.shape[0])
    mine = _chunks(layout, layout.index, length)
    q_parts = q.chunk(len(mine), SEQ)
    acc = [None] * len(mine)
    kv = (k.contiguous(), v.contiguous())
    for step in range(layout.size):
        pending = ring.start(kv) if step < layout.size - 1 else None
        visiting = _chunks(layout, (layout.index - step) % layout.size, length)
        k_parts, v_parts = kv[0].chunk(len(visiting), SEQ), kv[1].chunk(len(visiting), SEQ)
        for i, q_span in enumerate(mine):
            for j, k_span in enumerate(visiting):
                got = kernel.forward(q_parts[i], k_parts[j], v_parts[j], masks, rows, q_span, k_span, causal,
                                     scale)
                if got is not None:
                    acc[i] = kernel.merge(acc[i], *got)
        k_parts = v_parts = None   # release the block just used before the next one arrives
        if pending is not None:
            kv = tuple(pending.wait())
            pending = None
    acc = [a if a is not None else kernel.empty_result(p, v) for a, p in zip(acc, q_parts)]
    platform = get_platform()
    out = platform.cat([a[0] for a in acc], SEQ).to(q.dtype)
    lse = platform.cat([a[1] for a in acc], SEQ)
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.args = (layout, masks, causal, scale)
    return out


def _block_grads(ctx, parts, visiting, kv, acc_dtype):
    """(dq per local chunk, dk, dv of the visiting block) for one ring step (None: all skipped)."""
    q_parts, g_parts, out_parts, lse_parts, mine = parts
    _, masks, causal, scale = ctx.args
    rows = Span(0, q_parts[0].shape[0])
    k_parts, v_parts = kv[0].chunk(len(visiting), SEQ), kv[1].chunk(len(visiting), SEQ)
    dq = [None] * len(mine)
    dk = [p.new_zeros(tuple(p.shape), dtype=acc_dtype) for p in k_parts]
    dv = [p.new_zeros(tuple(p.shape), dtype=acc_dtype) for p in v_parts]
    for i, q_span in enumerate(mine):
        for j, k_span in enumerate(visiting):
            got = kernel.backward(g_parts[i], q_parts[i], k_parts[j], v_parts[j], out_parts[i], lse_parts[i],
                                  masks, rows, q_span, k_span, causal, scale)
            if got is None:
                continue
            dq[i] = got[0] if dq[i] is None else dq[i] + got[0]
            dk[j], dv[j] = dk[j] + got[1], dv[j] + got[2]
    cat = get_platform().cat
    return dq, (dk[0] if len(dk) == 1 else cat(dk, SEQ)), (dv[0] if len(dv) == 1 else cat(dv, SEQ))


def _backward(ctx, grad_out):
    q, k, v, out, lse = ctx.saved_tensors
    layout = ctx.args[0]
    ring, length = _Ring(layout), q.shape[SEQ]
    mine = _chunks(layout, layout.index, length)
    n = len(mine)
    parts = (q.chunk(n, SEQ), grad_out.contiguous().chunk(n, SEQ), out.chunk(n, SEQ), lse.chunk(n, SEQ), mine)
    dq = [p.new_zeros(tuple(p.shape), dtype=lse.dtype) for p in parts[0]]
    kv = (k.contiguous(), v.contiguous())
    own = travelling = None
    for step in range(layout.size):
        pending = ring.start(kv) if step < layout.size - 1 else None
        visiting = _chunks(layout, (layout.index - step) % layout.size, length)
        dqs, dk, dv = _block_grads(ctx, parts, visiting, kv, lse.dtype)
        dq = [a if b is None else a + b for a, b in zip(dq, dqs)]
        if step == 0:
            own = (dk, dv)
        else:
            if travelling is not None:
                dk, dv = dk + travelling[0], dv + travelling[1]
            # hand this block's gradient on; receive the one for the block held next (or our own)
            travelling = tuple(ring.start((dk, dv)).wait())
        dk = dv = None
        if pending is not None:
            kv = tuple(pending.wait())
            pending = None
    dk, dv = own
    if travelling is not None:
        dk, dv = dk + travelling[0], dv + travelling[1]
    grad_q = get_platform().cat(dq, SEQ) if n > 1 else dq[0]
    return grad_q.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


_fn = []


def masked_ring_attention(q, k, v, layout, masks, causal=False, scale=None):
    """Ring attention of this rank's (batch, heads, seq, dim) blocks under ``masks`` (masks.py)."""
    if q.ndim != 4:
        raise ValueError(f"attention_masks: ring attention needs (batch, heads, seq, dim) blocks, got "
                         f"{q.ndim}-D q")
    if q.shape[-3] % k.shape[-3]:
        raise ValueError(f"ring attention: {q.shape[-3]} query heads are not a multiple of {k.shape[-3]} "
                         f"key/value heads")
    if q.shape[0] != masks.batch_and_length[0]:
        raise ValueError(f"attention_masks: ring attention got {q.shape[0]} batch rows here, the masks "
                         f"{masks.batch_and_length[0]}; the ring does not support a batch split outside the "
                         f"CP mesh")
    if not _fn:
        _fn.append(get_platform().make_autograd_function("MaskedRingAttention", _forward, _backward))
    return _fn[0](q, k, v, layout, masks, causal, scale)


__all__ = ["masked_ring_attention"]
