"""Ring attention under ``attention_masks`` (packed documents, padding, with or without causal).

The ring is ring.py's, hop overlap and input-dtype dK/dV sends included; only the block kernel
differs: each (local q chunk, visiting k chunk) pair runs the masked tile kernel
(masked_attention.py) with the pair's global positions, so the tile masks come from the document
ids / padding of the q chunk's rows and the visiting chunk's keys, and a pair or tile that a
document boundary, padding or the causal diagonal empties is skipped without compute. With zigzag
(load balancing) each rank holds chunks 2r and 2P-1-2r, and the positions follow them.
"""
from typing import Any

from hyper_parallel.core.attention import masked_attention as kernel
from hyper_parallel.core.attention.block_masks import Span
from hyper_parallel.core.context_parallel.ring.ring_attention import run_ring

BATCH = 0


class MaskedBlocks:
    """The block kernel of the masked ring: masked_attention's forward/backward on one pair."""
    merge = staticmethod(kernel.merge)     # keeps rows that saw no key at (0, -inf)
    empty = staticmethod(kernel.empty_result)

    def __init__(self, masks: Any, causal: Any, scale: Any, softcap: Any = None, window: Any = None) -> None:
        self.masks, self.causal, self.scale, self.softcap, self.window = masks, causal, scale, softcap, window

    def forward(self, q: Any, k: Any, v: Any, q_span: Any, k_span: Any) -> Any:
        rows = Span(0, q.shape[BATCH])
        return kernel.forward(q, k, v, self.masks, rows, q_span, k_span, self.causal, self.scale,
                              self.softcap, self.window)

    def backward(self, grad_out: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, q_span: Any,
                 k_span: Any) -> Any:
        rows = Span(0, q.shape[BATCH])
        return kernel.backward(grad_out, q, k, v, out, lse, self.masks, rows, q_span, k_span, self.causal,
                               self.scale, self.softcap, self.window)


def masked_ring_attention(q: Any, k: Any, v: Any, layout: Any, masks: Any, causal: bool = False,
                          scale: Any = None, softcap: Any = None, sinks: Any = None,
                          window: Any = None) -> Any:
    """Ring attention of this rank's (batch, heads, seq, dim) blocks under ``masks`` (masks.py);
    ``softcap``, ``sinks`` (this rank's query heads) and ``window`` as ``hyper_parallel.attention``'s."""
    if q.ndim != 4:
        raise ValueError(f"attention_masks: ring attention needs (batch, heads, seq, dim) blocks, got "
                         f"{q.ndim}-D q")
    if q.shape[BATCH] != masks.batch_and_length[0]:
        raise ValueError(f"attention_masks: ring attention got {q.shape[BATCH]} batch rows here, the masks "
                         f"{masks.batch_and_length[0]}; the ring does not support a batch split outside the "
                         f"CP mesh")
    return run_ring(q, k, v, layout, MaskedBlocks(masks, causal, scale, softcap, window), sinks)


__all__ = ["MaskedBlocks", "masked_ring_attention"]
