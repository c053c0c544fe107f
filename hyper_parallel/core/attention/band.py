"""Which keys a block of queries sees under causal masking and a sliding window, by global position.

Query i sees key j when (not causal or j <= i) and (window is None or j > i - window): Hugging
Face's ``sliding_window`` = w keeps the w most recent keys, the query's own included. A pair of a
query block and a key block is then ``skip`` (no visible pair: no kernel runs for it), ``full``
(every pair visible: no mask), ``diag`` (the blocks start at the same position and the window
reaches past the block, so the kernel's own top-left causal mask is exact) or ``mask`` (a boolean
mask from the positions). Every context-parallel mode asks this one function, so a block that lies
wholly outside the window is skipped the same way in all of them.
"""
from typing import Any
from hyper_parallel.platform import get_platform


def relation(q_start: Any, q_len: Any, k_start: Any, k_len: Any, causal: Any, window: Any) -> str:
    """``skip`` / ``full`` / ``diag`` / ``mask`` for queries [q_start, +q_len) and keys [k_start, +k_len)."""
    if q_len <= 0 or k_len <= 0:
        return "skip"
    q_last, k_last = q_start + q_len - 1, k_start + k_len - 1
    if causal and k_start > q_last:
        return "skip"
    if window is not None and k_last <= q_start - window:
        return "skip"
    window_whole = window is None or k_start > q_last - window
    if window_whole and (not causal or k_last <= q_start):
        return "full"
    if window_whole and k_start == q_start:
        return "diag"
    return "mask"


def band_mask(q_start: Any, q_len: Any, k_start: Any, k_len: Any, causal: Any, window: Any,
              device: Any) -> Any:
    """Boolean (1, 1, q_len, k_len), True where query q_start + i may see key k_start + j."""
    platform = get_platform()
    rows = (platform.arange(q_len, device=device) + q_start).reshape((q_len, 1))
    cols = (platform.arange(k_len, device=device) + k_start).reshape((1, k_len))
    allowed: Any = cols <= rows if causal else None
    if window is not None:
        inside = cols > rows - window
        allowed = inside if allowed is None else allowed & inside
    return allowed.reshape((1, 1, q_len, k_len))


def key_cuts(q_start: Any, q_len: Any, k_len: Any, window: Any) -> Any:
    """Cut points of keys [0, k_len) for queries [q_start, +q_len): at the queries' first position
    (the keys before them form one block, the diagonal starts the next) and, with a window, at the
    first key any of them can see, so the keys before it form a block that ``relation`` skips."""
    cuts = {0, k_len}
    if 0 < q_start < k_len:
        cuts.add(q_start)
    if window is not None and 0 < q_start - window + 1 < k_len:
        cuts.add(q_start - window + 1)
    return sorted(cuts)


__all__ = ["band_mask", "key_cuts", "relation"]
