"""A context-parallel attention call in two halves (``start_attention``): ``start`` checks q, k, v
and launches their collective (Ulysses' fused all-to-all, or all-gather KV's gather); ``finish``
waits for it, runs the attention module and moves its output back. Whatever the caller computes
in between — the next head group's q/k/v projections, in the pipelined attention blocks of
integrations/hf_overlap.py — runs while the collective travels. In backward the same split holds:
the collective's autograd nodes are created at ``start`` and ``finish``, so the gradient
collective starts at finish's node and is waited for at start's, and what was computed in between
in forward (newer nodes) runs backward while it travels.

Calls whose moves do not split (masks, load balancing, the ring, a q DTensor on another mesh,
layouts that need several collectives in one stage) run whole at ``start``; ``finish`` returns
their output. The values are those of an ordinary call either way.
"""
from typing import Any
from hyper_parallel.core.bounded_cache import lifetime_key
from hyper_parallel.core.context_parallel.mode import agreeing, deliver, prepare, run_prepared
from hyper_parallel.core.context_parallel.output import first_output, to_caller
from hyper_parallel.core.context_parallel.overlap.pipeline import start_whole


class PendingAttention:
    """A started attention call; ``finish()`` returns its output (once computed, the same object)."""

    def __init__(self, finish: Any) -> None:
        self._finish, self._out = finish, None

    def finish(self) -> Any:
        if self._finish is not None:
            self._out, self._finish = self._finish(), None
        return self._out


def _splittable(style, inputs, gather_dims, masks):
    return (masks is None and not style.load_balance and inputs.policy != "other_mesh"
            and not (style.kv_exchange == "ring" and gather_dims))


def start_call(style: Any, cp_mesh: Any, qkv: Any, call: Any) -> Any:
    """``call(q, k, v)`` (the module, on DTensors in the mode's layout) as a ``PendingAttention``."""
    inputs, ulysses_dims, gather_dims, masks = prepare(style, cp_mesh, qkv)
    call = agreeing(inputs.mesh, call, lifetime_key(style))   # the kernel's settings compared across ranks
    pipe = None
    if _splittable(style, inputs, gather_dims, masks):
        pipe = start_whole(inputs, ulysses_dims, gather_dims)
    if pipe is None:
        out = run_prepared(style, inputs, ulysses_dims, gather_dims, masks, call)
        return PendingAttention(lambda: out)

    def finish():
        q, k, v = pipe.complete(inputs.mesh)
        out = first_output(call(q, k, v))
        return deliver(style, inputs, *to_caller(out, inputs, ulysses_dims))
    return PendingAttention(finish)
