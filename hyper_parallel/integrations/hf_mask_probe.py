"""What a Hugging Face model's own attention masks restrict, read from the model's mask construction.

Some attention restrictions live only in the mask transformers builds (``create_causal_mask``,
``create_sliding_window_causal_mask``, ``create_chunked_causal_mask``, ``create_bidirectional_mask``
and any model-specific overlay): Qwen2-MoE's and PhiMoE's sliding windows, Llama 4's chunked
attention, bidirectional layers. Context-parallel attention builds no S×S mask, so such a
restriction would be dropped in silence. Instead of listing classes, the CP attention name is also
registered with transformers' ``AttentionMaskInterface``: every mask the model creates comes back
as a ``MaskSpec`` holding the model's own ``mask_function(batch, head, q_idx, kv_idx)``, which reaches
the attention call of each layer as its ``attention_mask``.

``classify`` evaluates that function on rows of a long index grid (no S×S tensor: a few rows of up to
2**21 keys) and names the pattern: plain causal, a sliding window of w keys, chunks of C tokens,
fully bidirectional. Each is reproduced by context parallelism (window= / document ids / causal=False,
in every mode); anything else (a bidirectional prefix, a pattern no rule fits) is refused by name.
The setup probe (hf_context_parallel.CPAttention.audit) classifies the mask of every attention
module once, with no padding and no packing folded in; the forward then applies that module's
restriction together with the padding / document masks gathered from the inputs.
"""
import functools
import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, Hashable, List, Optional, Tuple

import torch

_MIN_GRID, _MAX_GRID = 2 ** 10, 2 ** 18
_LENGTH_WORDS = ("window", "chunk", "position", "length", "seq", "context")
_BEYOND = 64   # keys probed past the query (a bidirectional part shows there)


@dataclass(eq=False)
class MaskSpec:
    """The mask transformers asked the attention implementation to build (handed back unbuilt).
    ``forward_masks``: the ``attention_masks`` keywords (global padding / document tensors) of the
    forward that built it, or None (none, or not known: the attention finds them by position_ids)."""
    mask_function: Callable
    q_length: int
    kv_length: int
    q_offset: int = 0
    kv_offset: int = 0
    forward_masks: Optional[Dict[str, torch.Tensor]] = None

    @property
    def ndim(self) -> int:   # a 4-D mask for code that checks attention_mask.ndim
        return 4

    def hp_graph_parts(self) -> Tuple[Hashable, List[torch.Tensor], Callable[[List[torch.Tensor]], Any]]:
        """How a compiled decoder layer takes this argument (compile_support.py): a hashable
        description its graph is keyed on (lengths, offsets, which masks, the function's name: a
        new function object each forward must not recompile), its tensors as graph inputs, and a
        rebuild from the traced tensors. The mask function itself only serves the setup probe
        (``classify``, once per module), so the first call's function is kept."""
        names = tuple(sorted(self.forward_masks or {}))
        tensors = [(self.forward_masks or {})[n] for n in names]
        name = getattr(self.mask_function, "__qualname__", type(self.mask_function).__name__)
        description = ("MaskSpec", name,
                       self.q_length, self.kv_length, self.q_offset, self.kv_offset,
                       self.forward_masks is not None, names)
        function, lengths = self.mask_function, (self.q_length, self.kv_length, self.q_offset, self.kv_offset)
        given = self.forward_masks is not None

        def rebuild(traced: List[torch.Tensor]) -> "MaskSpec":
            return MaskSpec(function, *lengths, forward_masks=dict(zip(names, traced)) if given else None)
        return description, tensors, rebuild


@dataclass(frozen=True)
class Restriction:
    """What the model's mask allows besides padding and documents."""
    causal: bool = True
    window: Optional[int] = None   # keys i - w < j <= i
    chunk: Optional[int] = None    # keys in the query's chunk of ``chunk`` tokens

    def describe(self) -> str:
        if not self.causal:
            return "bidirectional"
        if self.window is not None:
            return f"sliding window of {self.window}"
        return f"chunks of {self.chunk}" if self.chunk is not None else "causal"


CAUSAL = Restriction()


def mask_interface(current_masks: Optional[Callable[[], Optional[dict]]] = None, **kwargs) -> MaskSpec:
    """Registered with transformers' AttentionMaskInterface under the CP attention name.
    ``current_masks``: the running forward's global masks ({} for none; None outside a forward),
    carried to the layers with the spec so that a compiled layer receives them as graph inputs."""
    masks = current_masks() if current_masks is not None else None
    return MaskSpec(kwargs["mask_function"], int(kwargs.get("q_length", 0) or 0),
                    int(kwargs.get("kv_length", 0) or 0), int(kwargs.get("q_offset", 0) or 0),
                    int(kwargs.get("kv_offset", 0) or 0), forward_masks=masks)


def register(name: str, current_masks: Optional[Callable[[], Optional[dict]]] = None) -> None:
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    interface = functools.partial(mask_interface, current_masks=current_masks)
    ALL_MASK_ATTENTION_FUNCTIONS.register(name, interface)


def grid_size(config) -> int:
    """Keys per probed row: past every length-like integer of the config (windows, chunks, max positions)."""
    lengths = [v for k, v in vars(config).items() if isinstance(v, int) and not isinstance(v, bool)
               and any(word in k for word in _LENGTH_WORDS)]
    return int(min(max([_MIN_GRID] + [2 * v + 2 for v in lengths if v < _MAX_GRID]), _MAX_GRID))


def _row(function, q: int, size: int) -> torch.Tensor:
    """Whether query q sees keys 0 .. q + _BEYOND (and the last key of the grid)."""
    keys = torch.arange(min(size, q + _BEYOND))
    if q + _BEYOND < size:
        keys = torch.cat([keys, torch.tensor([size - 1])])
    zero = torch.zeros((), dtype=torch.long)
    allowed = function(zero, zero, torch.tensor(q), keys)
    allowed = torch.as_tensor(allowed, dtype=torch.bool)
    return allowed.expand(keys.shape) if allowed.ndim == 0 else allowed.reshape(-1)


def _queries(size: int):
    qs = set(range(min(size, 70)))
    q = 70
    while q < size:
        qs.update((q, q + 1, q - 1))
        q = int(q * 1.7)
    qs.update((size - 1, size - 2, size // 2, size // 2 + 1))
    return sorted(x for x in qs if 0 <= x < size)


def classify(spec: MaskSpec, size: int) -> Tuple[Optional[Restriction], str]:
    """(Restriction, "") for a pattern context parallelism reproduces, else (None, why)."""
    lows, bidirectional_rows = {}, 0
    try:
        rows = {q: _row(spec.mask_function, q, size) for q in _queries(size)}
    except Exception as error:   # a mask function that reads more than the indices
        return None, (f"its mask function cannot be evaluated on global indices "
                      f"({type(error).__name__}: {error})")
    for q, row in rows.items():
        if bool(row[q + 1:].any()):
            bidirectional_rows += 1
            continue
        row = row[:q + 1]
        count, first = int(row.sum()), int(row.to(torch.uint8).argmax())
        if count == 0 or not bool(row[q]) or count != q - first + 1:
            return None, f"query {q} sees keys that are not one contiguous run ending at itself"
        lows[q] = first
    if bidirectional_rows:
        if bidirectional_rows >= len(rows) - 1 and all(bool(row.all()) for row in rows.values()):
            return Restriction(causal=False), ""
        return None, "bidirectional attention over part of the sequence (a prefix or a local window)"
    return _causal_kind(lows)


def _causal_kind(lows) -> Tuple[Optional[Restriction], str]:
    if all(lo == 0 for lo in lows.values()):
        return CAUSAL, ""
    cut = [q for q, lo in lows.items() if lo > 0]
    window = cut[-1] - lows[cut[-1]] + 1
    if all(lo == max(0, q - window + 1) for q, lo in lows.items()):
        return Restriction(window=window), ""
    chunk = math.gcd(*[lows[q] for q in cut])
    if chunk > 1 and all(lo == q - q % chunk for q, lo in lows.items()):
        return Restriction(chunk=chunk), ""
    return None, "a causal mask whose visible keys follow neither a sliding window nor fixed chunks"


def separates_documents(spec: Any, first: int) -> bool:
    """Whether the mask keeps the token at ``first`` (a packed document's first one) from the key before
    it: transformers' masks separate packed documents where the model hands them its position_ids."""
    zero = torch.zeros((), dtype=torch.long)
    try:
        allowed = spec.mask_function(zero, zero, torch.tensor(first), torch.tensor(first - 1))
    except Exception:   # a function that takes no scalar indices: assume it does, as before
        return True
    return not bool(torch.as_tensor(allowed).all())


def with_chunks(masks, chunk: int, batch: int, total: int):
    """``attention_masks`` keywords for chunked attention: a query sees the keys of its own chunk of the
    global token index (counted from the first real token of a left-padded row, as transformers'
    ``chunked_overlay``; of packed documents, from each document's first token, as transformers evaluates
    the mask on their positions), intersected with the documents and padding already there."""
    masks = dict(masks or {})
    index = torch.arange(total).expand(batch, total)
    padding = masks.get("padding_mask")
    if padding is not None:
        index = index - (padding.long().cumsum(-1) == 0).sum(-1, keepdim=True)
    documents = masks.get("document_ids")
    if documents is not None:   # packed: transformers chunks each document's positions (from 0, checked)
        documents = documents.long().expand(batch, total)
        first = torch.cat([torch.ones(batch, 1, dtype=torch.bool), documents[:, 1:] != documents[:, :-1]], 1)
        starts = torch.where(first, index, torch.zeros_like(index)).cummax(-1).values
        index = index - starts
    ids = torch.div(index, chunk, rounding_mode="floor") + total + 1   # >= 0 (left padding counts down)
    if documents is not None:
        ids = documents * (2 * total + 2) + ids
    masks["document_ids"] = ids
    return masks
