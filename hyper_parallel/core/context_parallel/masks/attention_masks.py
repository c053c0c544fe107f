"""Padding masks and packed documents for ContextParallel, without a dense S×S mask.

The public API is one context manager, active around the forward of the model::

    with attention_masks(document_ids=ids, padding_mask=am):
        loss = model(batch)
    loss.backward()          # the masks were captured in forward; backward needs no context

* ``document_ids`` (B, S) integers: token i may attend key j only when both carry the same id
  (packed sequences: every document is its own attention problem);
* ``cu_seqlens`` (n+1,) cumulative document lengths over the batch rows laid end to end (the
  flash-attention varlen convention: 0 = cu[0] <= cu[1] <= ... = cu[n] = B·S); another spelling of
  ``document_ids`` (give one of them);
* ``padding_mask`` (B, S) bool/0-1: True (1) marks a real token that queries may attend, False (0)
  padding that no query attends -- Hugging Face's ``attention_mask`` convention, the inverse of
  ``nn.MultiheadAttention``'s ``key_padding_mask``.

They combine with each other and with the module's ``is_causal`` (global positions: key j is
visible to query i when j <= i). S is the *global* sequence length, the ranks' blocks in rank order
(the order of the inputs; with load balancing too, whose exchange is internal), and every rank
passes the same tensors (O(B·S) integers, no S×S). Pass them on the CPU: the per-block decisions
(skip / full / causal / masked) then never synchronise an accelerator stream.

A query row with no visible key gives 0 and zero gradients, as torch's scaled_dot_product_attention
gives for a fully masked row on one device.
"""
from typing import Any, Iterator, Optional, Sequence, Tuple, Union
import contextlib
import contextvars
from dataclasses import dataclass

from hyper_parallel.core.arguments import check_int
from hyper_parallel.core.typing import Tensor
from hyper_parallel.platform import get_platform

DEFAULT_BLOCK = 256
_active: contextvars.ContextVar[Any] = contextvars.ContextVar("hp_cp_attention_masks", default=None)


@dataclass(frozen=True)
class AttentionMasks:
    document_ids: Any = None   # (B, S) integer tensor, or None
    padding: Any = None        # (B, S) bool tensor (True: may be attended), or None
    block_size: int = DEFAULT_BLOCK

    @property
    def batch_and_length(self) -> Tuple[int, ...]:
        t = self.document_ids if self.document_ids is not None else self.padding
        return tuple(t.shape)


def _as_2d(name, t):
    if t is None:
        return None
    if getattr(t, "ndim", None) != 2:
        raise ValueError(f"attention_masks: {name} must be a (batch, seq) tensor for the whole sequence, got "
                         f"shape {tuple(getattr(t, 'shape', ()))}")
    return t


def _ids_from_cu_seqlens(cu_seqlens, padding, document_ids):
    """(B·S,) document ids from cumulative lengths: a token's id is how many documents end at or
    before it (no sort, no search: one scatter of boundary marks and a cumulative sum)."""
    if document_ids is not None:
        raise ValueError("attention_masks: give document_ids or cu_seqlens, not both")
    if getattr(cu_seqlens, "ndim", None) != 1 or cu_seqlens.shape[0] < 2:
        raise ValueError(f"attention_masks: cu_seqlens must be 1-D with at least 2 entries (0, ..., total), "
                         f"got shape {tuple(getattr(cu_seqlens, 'shape', ()))}")
    bounds = [int(x) for x in cu_seqlens.tolist()]
    if bounds[0] != 0 or any(b < a for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"attention_masks: cu_seqlens must start at 0 and never decrease, got {bounds}")
    marks = [0] * bounds[-1]
    for b in bounds[1:-1]:
        if b < bounds[-1]:
            marks[b] += 1
    ids, run = [], 0
    for m in marks:
        run += m
        ids.append(run)
    return get_platform().tensor(ids, device=cu_seqlens.device), bounds[-1]


@contextlib.contextmanager
def attention_masks(document_ids: Optional[Tensor] = None,
                    cu_seqlens: Union[Tensor, Sequence[int], None] = None,
                    padding_mask: Optional[Tensor] = None, batch: Optional[int] = None,
                    block_size: int = DEFAULT_BLOCK) -> Iterator[Optional["AttentionMasks"]]:
    """Apply packed-document and/or padding masks to every ContextParallel attention call inside.

    ``batch`` is needed only with ``cu_seqlens`` and no ``padding_mask`` (to fold the B·S tokens
    into rows; 1 by default). ``block_size``: the query/key tile of the masked kernels (each tile's
    mask is B×block×block booleans; a tile the masks empty is skipped)."""
    check_int("attention_masks", "block_size", block_size, minimum=1,
              fix="the tile size of the masked kernels (256)")
    document_ids, padding_mask = _as_2d("document_ids", document_ids), _as_2d("padding_mask", padding_mask)
    if cu_seqlens is not None:
        flat, total = _ids_from_cu_seqlens(cu_seqlens, padding_mask, document_ids)
        rows = padding_mask.shape[0] if padding_mask is not None else (batch or 1)
        if total % rows:
            raise ValueError(f"attention_masks: cu_seqlens covers {total} tokens, not a multiple of the "
                             f"batch size {rows}; cu_seqlens[-1] must be batch·seq")
        document_ids = flat.reshape((rows, total // rows))
    if padding_mask is not None:
        padding_mask = padding_mask != 0
    if document_ids is not None and padding_mask is not None and \
            tuple(document_ids.shape) != tuple(padding_mask.shape):
        raise ValueError(f"attention_masks: document ids {tuple(document_ids.shape)} and padding_mask "
                         f"{tuple(padding_mask.shape)} must have one (batch, seq) shape")
    masks = None
    if document_ids is not None or padding_mask is not None:
        masks = AttentionMasks(document_ids, padding_mask, block_size)
    token = _active.set(masks)
    try:
        yield masks
    finally:
        _active.reset(token)


def active_masks() -> Optional["AttentionMasks"]:
    """The masks of the innermost ``attention_masks`` context, or None."""
    return _active.get()


def check_masks(masks: "AttentionMasks", batch: int, seq_len: int, kv_len: int) -> None:
    """ValueError (on every rank alike: the masks are the same everywhere) unless the masks cover
    the global (batch, seq) of this call."""
    if kv_len != seq_len:
        raise ValueError(f"attention_masks: q has global sequence length {seq_len} and k/v {kv_len}; the "
                         f"masks describe one sequence, so q, k and v must have the same length")
    if masks.batch_and_length != (batch, seq_len):
        raise ValueError(f"attention_masks: the masks are {masks.batch_and_length} (batch, seq), but this "
                         f"attention call has batch {batch} and global sequence length {seq_len}; pass the "
                         f"masks of the whole sequence (every rank the same tensors), not a rank's block")


__all__ = ["AttentionMasks", "attention_masks", "active_masks", "check_masks"]
