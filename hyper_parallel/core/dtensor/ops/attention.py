"""scaled_dot_product_attention on (..., heads, seq, dim) DTensors.

Per mesh dim one of: everything replicated; batch or heads split on q, k, v alike (heads must
divide evenly, GQA groups stay together; k and v take q's exact placement so their heads line up
with q's even when they arrived split differently); or queries split along the sequence with k and
v replicated — the all-gather-KV form of context parallelism. In that last form the causal mask is
the global one: each rank's query rows [r0, r0+L) may see keys j <= r0 + i, so keys past r0 + L
are dropped before the kernel runs. The visible keys are attended in two blocks merged by their
log-sum-exp: [0, r0), seen by every local row, and the diagonal block [r0, r0+L) under the
kernel's own causal mask. No row's scores ever include a key it may not see, so a NaN or inf in an
excluded key stays out of that row exactly as in single-device causal attention (an additive
-inf mask would turn NaN + -inf into NaN). An explicit global mask is sliced to the local rows by
the same redistribution that splits q.
"""
from typing import Any
from hyper_parallel.core.agreement_attention import agree_on_attention
from hyper_parallel.core.autograd_functions import lazy_autograd_function
from hyper_parallel.core.dtensor.layout import numel
from hyper_parallel.core.dtensor.ops.attention_roles import check_query
from hyper_parallel.core.dtensor.ops.registry import OpStrategy, register_rule
from hyper_parallel.core.dtensor.ops.strategy_search import pick
from hyper_parallel.core.dtensor.placement_types import Replicate, Shard
from hyper_parallel.platform import get_platform

ARG_NAMES = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")


def _mask_placement(p, q_ndim, mask_shape):
    if not p.is_shard():
        return p
    dim = p.dim - (q_ndim - len(mask_shape))
    if dim < 0 or mask_shape[dim] == 1:
        return Replicate()
    return p.with_dim(dim)


def _candidates(qs, ks, vs, m, n):
    nd = qs.ndim
    pq = qs.placements[m]
    cands = [([Replicate()] * 3, Replicate())]
    for d in range(nd - 2):
        if qs.shape[d] % n or ks.shape[d] % n:
            continue  # heads (or batch) must split evenly; GQA groups then stay together
        # k and v take q's placement itself, not just "some split of dim d": a StridedShard and a
        # Shard of the heads hold different heads, and pairing them would attend the wrong heads
        pick_q = pq if pq.is_shard(d) else Shard(d)
        cands.append(([pick_q, pick_q, pick_q], pick_q))
    seq_q = pq if pq.is_shard(nd - 2) else Shard(nd - 2)
    cands.append(([seq_q, Replicate(), Replicate()], seq_q))
    return cands


@register_rule("sdpa")
def sdpa_rule(call: Any) -> Any:
    q, k, v = (call.arg(i, ARG_NAMES[i]) for i in range(3))
    qs, ks, vs = call.spec(q), call.spec(k), call.spec(v)
    if qs is None or ks is None or vs is None or qs.ndim < 3:
        return None
    check_query(qs)   # inside a ContextParallel call: q split as that call promised (attention_roles.py)
    agree_on_attention(call)   # ... and its ranks call the kernel alike (core/agreement_attention.py)
    if (call.arg(4, "dropout_p", 0.0) or 0.0) > 0:
        return _replicated_strategy(call)
    mask = call.arg(3, "attn_mask")
    mask_spec = call.spec(mask)
    q_t, k_t, v_t, out, seq_split = [], [], [], [], False
    for m in range(call.mesh_ndim):
        current = [qs.placements[m], ks.placements[m], vs.placements[m]]
        (tq, tk, tv), po = pick(_candidates(qs, ks, vs, m, call.mesh.size(m)), current,
                                [numel(s.shape) for s in (qs, ks, vs)], call.mesh.size(m))
        seq_split |= tq.is_shard(qs.ndim - 2)
        q_t.append(tq)
        k_t.append(tk)
        v_t.append(tv)
        out.append(po)
    inputs = [None] * len(call.specs)
    inputs[call.index(q)], inputs[call.index(k)], inputs[call.index(v)] = tuple(q_t), tuple(k_t), tuple(v_t)
    if mask_spec is not None:
        inputs[call.index(mask)] = tuple(_mask_placement(p, qs.ndim, mask_spec.shape) for p in out)
    local = None
    if seq_split and call.arg(5, "is_causal", False):
        row_start, _ = qs.with_placements(tuple(q_t)).local_box()[qs.ndim - 2]
        local = _offset_causal(row_start)
    return OpStrategy(inputs=inputs, outputs=tuple(out), local=local)


def _replicated_strategy(call):
    """Attention dropout draws its mask inside the kernel, from the local shapes: only the whole
    computation on every rank draws the single-device mask under the same seed (random ops on
    DTensors equal one device). Every input is replicated; the output is too."""
    replicated = (Replicate(),) * call.mesh_ndim
    return OpStrategy(inputs=[replicated] * len(call.specs), outputs=replicated)


def _as_4d(attend, q, k, v):
    """Run ``attend`` on (batch, heads, seq, dim) views: the block kernels take exactly 4 dims, sdpa
    takes (seq, dim) with any leading dims (none, one, several)."""
    if q.ndim == 4:
        return attend(q, k, v)

    def four(t):
        return t.reshape((-1, t.shape[-3] if t.ndim > 2 else 1) + tuple(t.shape[-2:]))
    out = attend(four(q), four(k), four(v))
    return out.reshape(tuple(q.shape[:-1]) + (out.shape[-1],))


def _offset_causal(row_start):
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


# ============================================================================ block attention
def expand_heads(t: Any, groups: Any) -> Any:
    return t if groups == 1 else t.repeat_interleave(groups, dim=-3)


def fold_heads(t: Any, groups: Any) -> Any:
    """Sum the gradients of the query heads that share one k/v head (GQA)."""
    if groups == 1:
        return t
    shape = tuple(t.shape)
    return t.reshape(shape[:-3] + (shape[-3] // groups, groups) + shape[-2:]).sum(-3)


def merge_blocks(acc: Any, out: Any, lse: Any) -> Any:
    """Combine two partial attentions over disjoint keys by their log-sum-exp."""
    if acc is None:
        return out.to(lse.dtype), lse
    acc_out, acc_lse = acc
    new_lse = acc_lse.logaddexp(lse)
    merged = (acc_out * (acc_lse - new_lse).exp().unsqueeze(-1)
              + out.to(lse.dtype) * (lse - new_lse).exp().unsqueeze(-1))
    return merged, new_lse


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
