"""The mask of one (query block, key block) tile, built from document ids and padding, never S×S.

A tile covers global query positions [q0, q0+ql) and key positions [k0, k0+kl) of batch rows
[b0, b0+nb). Its kind decides what the kernel runs:

* ``skip``: no query of the tile sees any key (another document, padding, above the causal
  diagonal, outside the sliding window) -- no compute at all;
* ``full``: every query sees every key -- the kernel without a mask;
* ``causal``: exactly the top-left causal triangle (q0 == k0) -- the kernel's own causal mask;
* ``masked``: anything else -- the kernel with the tile's boolean mask (nb, 1, ql, kl), built from
  the ids when the kernel reaches the tile and dropped after it (``tile_mask``).

The decisions are computed where the ids live (on the CPU when the caller follows the advice in
masks.py), and only a ``masked`` tile's mask moves to the device of q.
"""
from typing import Any
from dataclasses import dataclass

from hyper_parallel.core.attention.band import band_mask, relation


@dataclass(frozen=True)
class Span:
    start: int
    length: int

    @property
    def stop(self) -> Any:
        return self.start + self.length


def spans(span: Any, size: Any) -> Any:
    """``span`` cut into consecutive tiles of at most ``size`` positions."""
    return [Span(s, min(size, span.stop - s)) for s in range(span.start, span.stop, size)]


_BY_POSITION = {"skip": "skip", "full": "full", "diag": "causal", "mask": None}


def _by_position(q, k, causal, window):
    """The kind of a tile under the causal mask and the sliding window alone (None: partly visible,
    not the plain diagonal); core/attention/band.py decides, as for the unmasked kernels."""
    return _BY_POSITION[relation(q.start, q.length, k.start, k.length, causal, window)]


def _content_mask(masks, rows, q, k):
    """(nb, ql, kl) booleans of documents and padding (None when neither is given)."""
    mask = None
    if masks.document_ids is not None:
        ids = masks.document_ids.narrow(0, rows.start, rows.length)
        q_ids, k_ids = ids.narrow(1, q.start, q.length), ids.narrow(1, k.start, k.length)
        mask = q_ids.unsqueeze(-1) == k_ids.unsqueeze(-2)
    if masks.padding is not None:
        keys = masks.padding.narrow(0, rows.start, rows.length).narrow(1, k.start, k.length).unsqueeze(-2)
        mask = keys.expand((rows.length, q.length, k.length)) if mask is None else mask & keys
    return mask


def _visible(masks, rows, q, k, causal, window=None):
    """(kind by the causal mask and window alone, the tile's (nb, ql, kl) visibility or None for
    all-visible, the positional (ql, kl) mask or None) of a tile."""
    by_causal = _by_position(q, k, causal, window)
    if by_causal == "skip":
        return "skip", None, None
    mask, triangle = _content_mask(masks, rows, q, k), None
    if by_causal != "full":
        device = mask.device if mask is not None else None
        triangle = band_mask(q.start, q.length, k.start, k.length, causal, window, device).reshape(
            (q.length, k.length))
        mask = triangle.unsqueeze(0) if mask is None else mask & triangle
        if mask.shape[0] != rows.length:
            mask = mask.expand((rows.length, q.length, k.length))
    return by_causal, mask, triangle


def tile_kind(masks: Any, rows: Any, q: Any, k: Any, causal: Any, window: Any = None) -> str:
    """The kind of one tile (the tile's mask is built to decide, then dropped: see ``tile_mask``)."""
    by_causal, mask, triangle = _visible(masks, rows, q, k, causal, window)
    if by_causal == "skip":
        return "skip"
    if by_causal == "causal" and bool((mask == triangle).all()):
        return "causal"
    if mask is None or bool(mask.all()):
        return "full"
    if not bool(mask.any()):
        return "skip"
    return "masked"


def tile_mask(masks: Any, rows: Any, q: Any, k: Any, causal: Any, window: Any = None) -> Any:
    """The (nb, 1, ql, kl) mask of a ``masked`` tile, built again where the kernel runs the tile, so
    no more than one tile's mask is alive at a time."""
    return _visible(masks, rows, q, k, causal, window)[1].unsqueeze(1)


__all__ = ["Span", "spans", "tile_kind", "tile_mask"]
