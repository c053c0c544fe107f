"""Attention settings compared across the ranks of the ContextParallel call around it.

ContextParallel checks its style, masks and q/k/v before it moves anything (context_parallel/checks.py).
What the module then passes to its attention kernel -- ``is_causal``, ``scale``, ``dropout_p``, an
explicit ``attn_mask``, ``enable_gqa``; ``hyper_parallel.attention``'s ``softcap``, ``window`` and
``sinks`` -- is only known where the kernel runs, so the sdpa rule and the ring / masks
interceptors call ``agree_on_attention(call)`` there (``hyper_parallel.attention`` calls
``agree_on_variant`` first thing, before it validates its arguments), before the kernel's own
collectives (the ring's K/V exchange) and before the output moves back. Every collective before
that point depends only on q/k/v's shapes, which the ranks have already agreed on, so the ranks
reach this check in step.

Outside a ContextParallel call (or MLA's attend path) it does nothing (``attention_call`` marks
the call). The schedule is core/agreement.py's: the first call of a site, a call whose settings
depart from the site's sequence, every call under ``HP_CHECK_RANKS=every``. A decision the
dispatcher cached for the sdpa rule is reused without the rule; the dispatcher then calls
``agree_on_repeated_attention``, so the site sees those calls too.
"""
import contextlib
import contextvars
from typing import Any, Hashable, Iterator, Optional

_CALL: contextvars.ContextVar[Optional[tuple]] = contextvars.ContextVar(
    "hp_agreement_attention_call", default=None)
_FIX = ("call the attention with the same arguments on every rank (is_causal, scale, dropout_p, attn_mask, "
        "softcap, window, sinks)")


@contextlib.contextmanager
def attention_call(mesh: Any, label: str, site: Optional[Hashable] = None) -> Iterator[None]:
    """Mark a ContextParallel call on ``mesh`` (its working mesh) for the attention kernel inside;
    ``site`` tells one call site's verified settings from another's."""
    token = _CALL.set((mesh, label, site))
    try:
        yield
    finally:
        _CALL.reset(token)


def _sdpa_settings(call: Any) -> dict:
    from hyper_parallel.core.agreement import Deferred, tensor_digest
    mask = call.arg(3, "attn_mask")
    return {"is_causal": bool(call.arg(5, "is_causal", False)), "scale": call.arg(6, "scale"),
            "dropout_p": call.arg(4, "dropout_p", 0.0) or 0.0, "attn_mask": mask,
            "enable_gqa": bool(call.kwargs.get("enable_gqa", False)),
            "attn_mask contents": Deferred(lambda: tensor_digest(mask))}


def _check(settings: dict) -> None:
    active = _CALL.get()
    if active is not None:
        # deferred: the dtensor package imports this module while it loads (ops/attention.py)
        from hyper_parallel.core.agreement import check_agreement
        mesh, label, site = active
        check_agreement(mesh, f"{label}: the attention call", settings, signature=("attention", site),
                        fix=_FIX)


def agree_on_attention(call: Any) -> None:
    """At an ``sdpa`` op inside a ContextParallel call: ValueError on every rank of its mesh unless
    every rank calls it with the same settings (a no-op elsewhere; ``hyper_parallel.attention``
    checks its own arguments with ``agree_on_variant`` before validating them)."""
    if call.name == "sdpa" and _CALL.get() is not None:
        _check(_sdpa_settings(call))


def agree_on_repeated_attention(call: Any) -> None:
    """A call whose sharding decision was cached skips the rule, and with it ``agree_on_attention``:
    the dispatcher calls this instead, so the call site still sees every call's settings (a rank
    going back alone to settings it used before checks again; a repeat costs no collective)."""
    if call.name == "sdpa" and _CALL.get() is not None:
        _check(_sdpa_settings(call))


def agree_on_variant(is_causal: object, scale: object, softcap: object, window: object,
                     sinks: object) -> None:
    """``hyper_parallel.attention``'s arguments inside a ContextParallel call, compared before any rank
    validates them (a rank whose arguments alone are invalid would raise alone, leaving its peers
    waiting); ``sinks`` by presence, shape and, where every rank holds all of it, a digest of its
    values (each rank would otherwise fold its own sinks into the heads it computes)."""
    from hyper_parallel.core.agreement import Deferred
    _check({"is_causal": is_causal, "scale": scale, "softcap": softcap, "window": window, "sinks": sinks,
            "sinks values": Deferred(lambda: _whole_digest(sinks))})


def _whole_digest(tensor: Any) -> Optional[str]:
    """A digest of ``tensor``'s values where every rank holds the whole of it (a plain tensor, or a
    DTensor replicated on every mesh dim); a sharded DTensor's pieces differ legitimately, and its
    layout is compared with its metadata."""
    from hyper_parallel.core.agreement import tensor_digest
    placements = getattr(tensor, "placements", None)
    if placements is not None and not all(p.is_replicate() for p in placements):
        return "sharded"
    return tensor_digest(tensor)
