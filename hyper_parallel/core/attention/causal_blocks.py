"""The ring's unmasked block kernel: a (local query chunk, visiting key chunk) pair given by its global
positions runs the platform's block attention (forward returns the log-sum-exp, backward restarts
from it), skipped, causal on the diagonal, or under the band's positional mask (core/attention/band.py).
The ring loop that drives it is core/context_parallel/ring/ring_attention.py; the masked kernel for
documents and padding is masked_ring.py's ``MaskedBlocks``.
"""
from typing import Any

from hyper_parallel.core.attention.band import band_mask, relation
from hyper_parallel.core.attention.lse import clear_empty_rows, merge, merge_blocks
from hyper_parallel.core.attention.masked_attention import empty_result
from hyper_parallel.core.attention.offset_causal import expand_heads, fold_heads
from hyper_parallel.platform import get_platform

HEADS = -3  # kernels see (batch, heads, seq, dim)


class CausalBlocks:
    """The unmasked block kernel: a key chunk after the query chunk is skipped under ``causal``, the
    same chunk runs the kernel's causal mask, an earlier one runs unmasked. With a sliding
    ``window`` a chunk wholly outside it is skipped too, and one it cuts runs a positional mask
    (core/attention/band.py); ``softcap`` goes to the block kernel."""
    empty = staticmethod(empty_result)   # never needed: every query chunk sees its own chunk
    repeats_kv = True                    # GQA: the whole K/V block is repeated to the query heads

    def __init__(self, causal: Any, scale: Any, softcap: Any = None, window: Any = None) -> None:
        self.causal, self.scale, self.softcap, self.window = causal, scale, softcap, window
        # a window can leave a row without keys in one chunk: the -inf-safe merge
        self.merge = merge_blocks if window is None else merge

    def _relation(self, q_span, k_span):
        return relation(q_span.start, q_span.length, k_span.start, k_span.length, self.causal, self.window)

    def _mask(self, relation_, q, q_span, k_span):
        if relation_ != "mask":
            return None
        return band_mask(q_span.start, q_span.length, k_span.start, k_span.length, self.causal, self.window,
                         q.device)

    def forward(self, q: Any, k: Any, v: Any, q_span: Any, k_span: Any) -> Any:
        kind = self._relation(q_span, k_span)
        if kind == "skip":
            return None
        groups, mask = q.shape[HEADS] // k.shape[HEADS], self._mask(kind, q, q_span, k_span)
        k, v = expand_heads(k, groups), expand_heads(v, groups)
        out, lse = get_platform().attention_block_forward(q, k, v, kind == "diag", self.scale, mask=mask,
                                                          softcap=self.softcap)
        return (out, lse) if mask is None else clear_empty_rows(out, lse, mask)

    def backward(self, grad_out: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, q_span: Any,
                 k_span: Any) -> Any:
        kind = self._relation(q_span, k_span)
        if kind == "skip":
            return None
        groups, mask = q.shape[HEADS] // k.shape[HEADS], self._mask(kind, q, q_span, k_span)
        dq, dk, dv = get_platform().attention_block_backward(
            grad_out, q, expand_heads(k, groups), expand_heads(v, groups), out, lse, kind == "diag",
            self.scale, mask=mask, softcap=self.softcap)
        return dq, fold_heads(dk, groups), fold_heads(dv, groups)


__all__ = ["CausalBlocks"]
