"""The sharding rule of ``hyper_parallel.attention`` (op "attention"): attention with soft-capping,
a sliding window or sinks on (batch, heads, seq, dim) DTensors.

The layouts are sdpa's (attention.py): per mesh dim everything replicated, batch or heads split on
q, k, v alike, or q split along the sequence with k, v replicated (all-gather KV, the head-tail
split included). The keys are whole on every rank in each of them, so the local op is
core/attention/variant_kernel.py on the local blocks, told the global position of its first query row
(the causal diagonal and the window are global) and which heads it holds (the sinks are one logit
per global head; a rank's gradient covers its heads and rows, summed over ranks by the caller's
data parallelism, as every parameter gradient under context parallelism is).
"""
from typing import Any
from hyper_parallel.core.dtensor.layout import numel
from hyper_parallel.core.dtensor.ops.attention import _candidates
from hyper_parallel.core.attention.roles import check_query
from hyper_parallel.core.attention.variant_kernel import Variant, variant_attention
from hyper_parallel.core.dtensor.ops.registry import OpStrategy, register_rule
from hyper_parallel.core.dtensor.ops.strategy_search import pick

ARG_NAMES = ("query", "key", "value")
SEQ, HEADS = 2, 1


class AttentionExtras:
    """The non-tensor part of one call, passed as a single opaque argument: the ``Variant`` and the
    sinks tensor. Opaque on purpose: a plain tensor argument beside DTensors would be promoted to a
    replicated DTensor whose gradient is all-reduced, while the sinks' gradient must stay this
    rank's share (its rows and heads) like every other parameter's under context parallelism."""
    __slots__ = ("variant", "sinks")

    def __init__(self, variant: Any, sinks: Any) -> None:
        self.variant, self.sinks = variant, sinks

    def __repr__(self):
        return f"AttentionExtras({self.variant}, sinks={'yes' if self.sinks is not None else 'no'})"


def _layouts(call, qs, ks, vs):
    q_t, k_t, v_t = [], [], []
    for m in range(call.mesh_ndim):
        current = [qs.placements[m], ks.placements[m], vs.placements[m]]
        (tq, tk, tv), _ = pick(_candidates(qs, ks, vs, m, call.mesh.size(m)), current,
                               [numel(s.shape) for s in (qs, ks, vs)], call.mesh.size(m))
        q_t.append(tq)
        k_t.append(tk)
        v_t.append(tv)
    return tuple(q_t), tuple(k_t), tuple(v_t)


def _check_heads(q_t, extras):
    if extras.sinks is None:
        return
    if any(type(p).__name__ == "StridedShard" and p.is_shard(HEADS) for p in q_t):
        raise ValueError("hyper_parallel.attention: sinks with q's heads split by a StridedShard (two mesh "
                         "dims splitting the heads) are not supported; split the heads on one mesh dim")


@register_rule("attention", cacheable=False)
def attention_rule(call: Any) -> Any:
    q, k, v = (call.arg(i, ARG_NAMES[i]) for i in range(3))
    qs, ks, vs = call.spec(q), call.spec(k), call.spec(v)
    if qs is None or ks is None or vs is None:
        return None
    check_query(qs)   # inside a ContextParallel call: q split as that call promised (core/attention/roles.py)
    extras = call.arg(3, "extras")
    q_t, k_t, v_t = _layouts(call, qs, ks, vs)
    q_start = qs.with_placements(q_t).local_box()[SEQ][0]
    inputs = [None] * len(call.specs)
    inputs[call.index(q)], inputs[call.index(k)], inputs[call.index(v)] = q_t, k_t, v_t
    call.set_out_shapes([tuple(qs.shape[:-1]) + (vs.shape[-1],)])

    sinks = local_sinks(extras.sinks, qs.with_placements(q_t))

    def local(call_, args, kwargs):
        values = [args[i] if i < len(args) else kwargs.get(ARG_NAMES[i]) for i in range(3)]
        return variant_attention(*values, sinks, q_start, extras.variant)
    return OpStrategy(inputs=inputs, outputs=q_t, local=local)


def call_variant(call: Any) -> Any:
    """(Variant, sinks or None) of an sdpa or "attention" call, for the interceptors that run their
    own kernels at it (ring, attention_masks)."""
    if call.name == "attention":
        # the output's global shape, told here: a meta run of the op would meet the real sinks tensor
        qs, vs = call.spec(call.arg(0, "query")), call.spec(call.arg(2, "value"))
        call.set_out_shapes([tuple(qs.shape[:-1]) + (vs.shape[-1],)])
        extras = call.arg(3, "extras")
        return extras.variant, extras.sinks
    return Variant(bool(call.arg(5, "is_causal", False)), call.arg(6, "scale")), None


def local_sinks(sinks: Any, q_spec: Any) -> Any:
    """The sink logits of the query heads this rank holds under ``q_spec`` (or None)."""
    if sinks is None:
        return None
    _check_heads(q_spec.placements, AttentionExtras(None, sinks))
    start, count = q_spec.local_box()[HEADS]
    return sinks if (start, count) == (0, sinks.shape[0]) else sinks.narrow(0, start, count)


__all__ = ["AttentionExtras", "attention_rule", "call_variant", "local_sinks"]
