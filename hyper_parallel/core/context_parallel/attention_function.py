"""``hyper_parallel.attention``: scaled dot-product attention with the variants that
``F.scaled_dot_product_attention`` has no argument for — logit soft-capping (Gemma 2), attention
sinks (gpt-oss) and a sliding window (Mistral, Gemma 2/3) — on plain tensors and DTensors alike.

A module under ContextParallel that needs a variant calls this instead of sdpa, in the same place
and with the same (batch, heads, seq, dim) tensors. On plain tensors it computes the attention
exactly (core/attention/variant_kernel.py); on DTensors it is the op "attention": its sharding rule
(core/dtensor/ops/attention_variants.py) serves Ulysses, all-gather KV (± load balance) and their
hybrid, and the ring and ``attention_masks`` interceptors run their block kernels with the same
variant. Every argument is checked here, before anything moves; what a mode cannot compute is a
ValueError naming the argument, never an argument dropped.
"""
from typing import Optional
from hyper_parallel.core.agreement_attention import agree_on_variant
from hyper_parallel.core.arguments import check_int, check_optional_float
from hyper_parallel.core.dtensor.dtensor import DTensor
from hyper_parallel.core.attention.variant_kernel import Variant, variant_attention
from hyper_parallel.core.dtensor.ops.attention_variants import AttentionExtras
from hyper_parallel.core.typing import Tensor


def _check(query, key, value, softcap, sinks, window, is_causal, scale):
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t.ndim != 4:
            raise ValueError(f"hyper_parallel.attention: {name} is {t.ndim}-D; pass (batch, heads, seq, dim)")
    heads, kv_heads = query.shape[1], key.shape[1]
    if kv_heads != value.shape[1] or heads % kv_heads:
        raise ValueError(f"hyper_parallel.attention: {heads} query heads need a divisor as key/value heads, "
                         f"got key {kv_heads}, value {value.shape[1]}")
    who = "hyper_parallel.attention"
    check_optional_float(who, "softcap", softcap, positive=True,
                         fix="a positive finite cap (e.g. 50.0) or None")
    check_optional_float(who, "scale", scale, fix="a finite scale or None (1/sqrt(dim))")
    if window is not None:
        check_int(who, "window", window, minimum=1, fix="the number of keys back (e.g. 4096) or None")
        if not is_causal:
            raise ValueError("hyper_parallel.attention: window needs is_causal=True (a sliding window counts "
                             "keys back from the query)")
    if sinks is not None:
        if isinstance(sinks, DTensor):
            raise ValueError("hyper_parallel.attention: sinks is a DTensor; pass the plain (heads,) tensor "
                             "(each rank's gradient is its share, summed by data parallelism)")
        if sinks.ndim != 1 or sinks.shape[0] != heads:
            raise ValueError(f"hyper_parallel.attention: sinks of shape {tuple(sinks.shape)} must be one "
                             f"logit per query head, ({heads},) here (under overlap=True the attention sees "
                             f"head groups: use overlap=False with sinks)")


def attention(query: Tensor, key: Tensor, value: Tensor, *, is_causal: bool = False,
              scale: Optional[float] = None, softcap: Optional[float] = None, sinks: Optional[Tensor] = None,
              window: Optional[int] = None) -> Tensor:
    """softmax(cap(q·kᵀ·scale) + mask ∪ sinks)·v on (batch, heads, seq, dim) tensors.

    is_causal: query i sees keys j <= i (top-left aligned). scale: default 1/sqrt(dim). softcap c:
    each score s becomes c·tanh(s / c) before the mask. sinks: one logit per query head added to
    the softmax denominator (no value; differentiable). window w (with is_causal): query i sees
    keys i - w < j <= i. k/v may have fewer heads (GQA: each serves a group of query heads)."""
    # ranks first (inside ContextParallel): a rank whose argument alone is invalid would otherwise raise
    # alone and leave its peers waiting. The check counts NaN equal to NaN, so a NaN softcap given on
    # every rank passes it and is then refused as such by _check, on every rank
    agree_on_variant(is_causal, scale, softcap, window, sinks)
    _check(query, key, value, softcap, sinks, window, is_causal, scale)
    variant = Variant(bool(is_causal), scale, softcap or None, window)
    dtensors = [t for t in (query, key, value) if isinstance(t, DTensor)]
    if not dtensors:
        return variant_attention(query, key, value, sinks, 0, variant)
    args = (query, key, value, AttentionExtras(variant, sinks))
    result = type(dtensors[0])._hp_function("attention", _local, args, {})
    if result is NotImplemented:
        raise ValueError("hyper_parallel.attention: no layout of these DTensors runs this attention (q, k, v "
                         "must be DTensors on one mesh)")
    return result


def _local(query, key, value, extras):
    """The op on local tensors (the rule supplies its own local function; this is the plain meaning)."""
    return variant_attention(query, key, value, extras.sinks, 0, extras.variant)


__all__ = ["attention"]
