"""scaled_dot_product_attention on (..., heads, seq, dim) DTensors.

Per mesh dim one of: everything replicated; batch or heads split on q, k, v alike (heads must
divide evenly, GQA groups stay together; k and v take q's exact placement so their heads line up
with q's even when they arrived split differently); or queries split along the sequence with k and
v replicated — the all-gather-KV form of context parallelism. In that last form the causal mask is
the global one: each rank's query rows [r0, r0+L) may see keys j <= r0 + i; the local kernel that
applies it is core/attention/offset_causal.py's (two key blocks merged by their log-sum-exp, no
excluded key in any row's scores). An explicit global mask is sliced to the local rows by the same
redistribution that splits q. This module is the rule only: placements, then the kernel.
"""
from typing import Any
from hyper_parallel.core.agreement_attention import agree_on_attention
from hyper_parallel.core.dtensor.layout import numel
from hyper_parallel.core.attention.offset_causal import ARG_NAMES, offset_causal
from hyper_parallel.core.attention.roles import check_query
from hyper_parallel.core.dtensor.ops.registry import OpStrategy, register_rule
from hyper_parallel.core.dtensor.ops.strategy_search import pick
from hyper_parallel.core.dtensor.placement_types import Replicate, Shard


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
    check_query(qs)   # inside a ContextParallel call: q split as that call promised (core/attention/roles.py)
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
        local = offset_causal(row_start)
    return OpStrategy(inputs=inputs, outputs=tuple(out), local=local)


def _replicated_strategy(call):
    """Attention dropout draws its mask inside the kernel, from the local shapes: only the whole
    computation on every rank draws the single-device mask under the same seed (random ops on
    DTensors equal one device). Every input is replicated; the output is too."""
    replicated = (Replicate(),) * call.mesh_ndim
    return OpStrategy(inputs=[replicated] * len(call.specs), outputs=replicated)


__all__ = ["ARG_NAMES", "sdpa_rule"]
