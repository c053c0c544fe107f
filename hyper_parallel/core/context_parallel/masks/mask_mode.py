"""ContextParallel under ``attention_masks`` (masks.py), in the modes that move q/k/v by DTensor
layouts (Ulysses, all-gather KV with or without load balancing, their hybrid).

The mode distributes q, k, v as usual; the module is then called with a dispatch interceptor
(core/dtensor/dispatch/interceptors.py) following them, which at ``F.scaled_dot_product_attention`` runs the
masked tile kernel (masked_attention.py) on the local blocks. Which global query rows and keys a
rank holds is read from the DTensor layouts at that point (q: a sequence block, a head-tail chunk
or everything; k/v: the whole sequence), so one interceptor serves every mode. The batch rows come
from the layouts too (a batch split elsewhere in the mesh slices the masks alike).
"""
from typing import Any
from hyper_parallel.core.agreement_attention import agree_on_attention
from hyper_parallel.core.attention.block_masks import Span
from hyper_parallel.core.attention.masked_attention import masked_attention
from hyper_parallel.core.dtensor.dispatch.interceptors import Interceptor, intercepting
from hyper_parallel.core.attention.offset_causal import ARG_NAMES
from hyper_parallel.core.attention.roles import SeqTracking
from hyper_parallel.core.dtensor.ops.attention_variants import call_variant, local_sinks
from hyper_parallel.core.dtensor.ops.registry import OpStrategy

PASS_THROUGH = frozenset({"transpose", "permute", "movedim", "t", "view", "identity", "cast", "expand",
                          "contiguous"})
CONSUMERS = frozenset({"sdpa", "attention", "npu_fusion_attention"})


def check_call(call: Any, kernel: Any) -> None:
    """ValueError unless the sdpa call can take the masks: no explicit mask, no dropout, 4-D."""
    if call.arg(3, "attn_mask") is not None:
        raise ValueError(f"attention_masks: the module also passes attn_mask to {kernel}; give the padding / "
                         f"documents through attention_masks(...) only (an explicit mask would be S×S)")
    if (call.arg(4, "dropout_p", 0.0) or 0.0) > 0:
        raise ValueError(f"attention_masks: dropout_p > 0 in {kernel} is not supported with the masks; "
                         f"set dropout_p=0 (attention dropout is not used in LLM pre-training)")
    q = call.arg(0, ARG_NAMES[0])
    if call.spec(q).ndim != 4:
        raise ValueError(f"attention_masks: {kernel} gets {call.spec(q).ndim}-D q; the masks need "
                         f"(batch, heads, seq, dim)")


def refusal(name: str, mode: Any) -> Any:
    return ValueError(f"ContextParallel with attention_masks ({mode}): q/k/v reach '{name}', but the "
                      f"masks are applied only by F.scaled_dot_product_attention; write the attention with "
                      f"it")


class MaskInterceptor(SeqTracking, Interceptor):
    pass_through = PASS_THROUGH
    consumers = CONSUMERS

    def __init__(self, masks: Any) -> None:
        super().__init__()
        self.masks = masks
        self.used = False

    def strategy(self, call: Any) -> Any:
        self.check_kernel(call)   # seq_dim must reach the kernel's sequence dim (core/attention/roles.py)
        if call.name not in ("sdpa", "attention"):
            raise ValueError("attention_masks with npu_fusion_attention under ContextParallel is not "
                             "supported (its TND actual_seq_qlen/kvlen cover packed sequences split along T "
                             "as data parallelism); use F.scaled_dot_product_attention here")
        q, k, v = (call.arg(i, ARG_NAMES[i]) for i in range(3))
        if not all(self.follows(t) for t in (q, k, v)):
            return None
        agree_on_attention(call)   # every rank's settings alike before one rank refuses them
        if call.name == "sdpa":
            check_call(call, "F.scaled_dot_product_attention")
        variant, sinks = call_variant(call)
        specs = [call.spec(t) for t in (q, k, v)]
        q_box, k_box = specs[0].local_box(), specs[1].local_box()
        seq_len = specs[0].shape[2]
        if k_box[2] != (0, seq_len) or specs[1].shape[2] != seq_len:
            raise ValueError(f"attention_masks: k holds keys {k_box[2]} of {specs[1].shape[2]} at the "
                             f"attention call, not the whole sequence of {seq_len}; this layout is not a "
                             f"ContextParallel mode the masks support")
        if k_box[0] != q_box[0]:
            raise ValueError(f"attention_masks: q and k hold different batch rows ({q_box[0]} vs {k_box[0]})")
        masks, sinks = self.masks, local_sinks(sinks, specs[0])
        rows, q_span, k_span = Span(*q_box[0]), Span(*q_box[2]), Span(0, seq_len)
        self.used = True

        def local(call_, args, kwargs):
            values = [args[i] if i < len(args) else kwargs.get(ARG_NAMES[i]) for i in range(3)]
            return masked_attention(*values, masks, rows, q_span, k_span, variant.causal, variant.scale,
                                    variant.softcap, sinks, variant.window)
        inputs = [None] * len(call.specs)
        for t, s in zip((q, k, v), specs):
            inputs[call.index(t)] = s.placements
        return OpStrategy(inputs=inputs, outputs=specs[0].placements, local=local)

    def refusal(self, name: str) -> Any:
        return refusal(name, "Ulysses / all-gather")


def with_masks(masks: Any, call: Any, seq: Any = None, label: str = "ContextParallel") -> Any:
    """``call`` (q, k, v DTensors → module output) with the masks applied at its attention op
    (q, k, v's sequence at dim ``seq``, checked there)."""
    def masked_call(q, k, v):
        interceptor = MaskInterceptor(masks)
        interceptor.track((q, k, v), seq, label)
        with intercepting(interceptor):
            out = call(q, k, v)
        if not interceptor.used:
            raise ValueError("ContextParallel with attention_masks: the module never called "
                             "F.scaled_dot_product_attention on q, k, v, so the masks were not applied")
        return out
    return masked_call


__all__ = ["MaskInterceptor", "with_masks", "check_call", "refusal"]
