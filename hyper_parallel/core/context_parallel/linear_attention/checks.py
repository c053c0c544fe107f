"""What the linear-attention entry points check before any data moves.

Every check reads only this rank's arguments, whose shapes CP ranks share (a rank's block differs
from another's in length only), so each raises the same ValueError on every rank before the first
collective. Messages name the offending value and the fix.
"""
import contextlib
from typing import Any, Iterator

MODES = ("allgather", "p2p")


def _dims(name, x, want):
    if x.dim() != want:
        raise ValueError(f"delta rule: {name} has {x.dim()} dims {tuple(x.shape)}; pass (batch, seq, heads"
                         f"{', dim' if want == 4 else ''}) per token")


def check_delta_rule(q: Any, k: Any, v: Any, g: Any, beta: Any, mode: Any, chunk_size: Any,
                     initial_state: Any) -> None:
    if mode not in MODES:
        raise ValueError(f"delta rule: mode={mode!r} is not one of {MODES}; pass 'allgather' (one "
                         "all-gather of the block summaries) or 'p2p' (states passed rank to rank)")
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"delta rule: chunk_size={chunk_size!r}; pass a positive int (64 in the reference)")
    for name, x in (("q", q), ("k", k), ("v", v)):
        _dims(name, x, 4)
    _dims("beta", beta, 3)
    b, t, h_k, d_k = k.shape
    h_v = v.shape[2]
    if tuple(q.shape) != tuple(k.shape) or v.shape[:2] != k.shape[:2] or h_v % h_k:
        raise ValueError(f"delta rule: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not "
                         "fit: q "
                         "and k must match and v's value heads must be a multiple of k's heads, same batch "
                         "and seq")
    gates = ((b, t, h_v), (b, t, h_v, d_k))
    if tuple(g.shape) not in gates or tuple(beta.shape) != gates[0]:
        raise ValueError(f"delta rule: g {tuple(g.shape)} / beta {tuple(beta.shape)}; pass g as {gates[0]} "
                         f"(a decay per head, GDN) or {gates[1]} (per channel, KDA) and beta as {gates[0]}")
    state = (b, h_v, d_k, v.shape[3])
    if initial_state is not None and tuple(initial_state.shape) != state:
        raise ValueError(f"delta rule: initial_state has shape {tuple(initial_state.shape)}; pass {state} "
                         "(batch, value heads, d_k, d_v), the same on every rank, or None")


def check_conv(x: Any, weight: Any, kernel: Any, local_length: Any) -> None:
    if weight.dim() != 2 or weight.shape[0] != x.shape[1]:
        raise ValueError(f"causal conv: weight {tuple(weight.shape)} for input {tuple(x.shape)}; pass the "
                         "depthwise weight as (channels, kernel) with x as (batch, channels, seq)")
    if local_length < kernel - 1:
        raise ValueError(f"causal conv: this rank's block has {local_length} tokens, fewer than the "
                         f"kernel's halo of {kernel - 1}; use fewer CP ranks or a longer sequence")


# ---------------------------------------------------------------------- ranks that agree (SPEC §19)
_FIX = ("call it alike on every CP rank: the same mode, chunk_size, scale and initial_state (the whole "
        "sequence's), and blocks of one batch, heads and dims")


def _without_seq(x):
    """A block's shape with its sequence length (dim 1, which may differ between ranks) left out."""
    shape = tuple(int(s) for s in x.shape)
    return (str(x.dtype),) + shape[:1] + shape[2:]


def agree_delta_rule(group: Any, q: Any, k: Any, v: Any, g: Any, beta: Any, mode: Any, chunk_size: Any,
                     initial_state: Any, use_qk_l2norm: Any, scale: Any) -> None:
    """ValueError on every CP rank unless every rank runs the delta rule alike (one small message at
    the first call of each combination; core/agreement.py). Before the per-rank checks: a rank whose
    arguments alone are invalid would raise alone and leave its peers in the state exchange."""
    from hyper_parallel.core.agreement import Deferred, check_agreement, tensor_digest
    from hyper_parallel.platform import get_platform
    settings = {"mode": mode, "chunk_size": chunk_size, "use_qk_l2norm": bool(use_qk_l2norm),
                "scale": scale, "initial_state": initial_state,
                "initial_state contents": Deferred(lambda: tensor_digest(initial_state)),
                "q/k/v/g/beta (dtype, batch, heads, dims)": tuple(map(_without_seq, (q, k, v, g, beta))),
                "grad mode (is_grad_enabled)": bool(get_platform().is_grad_enabled())}
    check_agreement(group, "linear attention (delta rule)", settings, signature=("delta rule", _site()),
                    fix=_FIX)


def agree_conv(group: Any, x: Any, weight: Any, bias: Any) -> None:
    """The causal convolution's halo exchange needs one kernel, and a long enough block, everywhere."""
    from hyper_parallel.core.agreement import check_agreement
    kernel = int(weight.shape[-1]) if weight.dim() else 0
    settings = {"weight": weight, "bias": bias,
                "x (dtype, batch, channels)": (str(x.dtype),) + tuple(int(s) for s in x.shape[:-1]),
                "block holds the kernel's halo": int(x.shape[-1]) >= kernel - 1}
    check_agreement(group, "linear attention (causal conv)", settings, signature=("causal conv", _site()),
                    fix=_FIX)


def _site() -> Any:
    """The parallelized module whose forward makes the call (running), or None for a
    direct call: a call site's checks remember its previous settings (core/agreement.py), so a
    rank that changes one alone after steady state checks again."""
    cp = active()
    return None if cp is None else cp[2]


_ACTIVE: list[Any] = []   # (group, mode, site) of the parallelized forwards running now, innermost last


@contextlib.contextmanager
def running(group: Any, mode: Any, site: Any = None) -> Iterator[None]:
    """The calls inside run on ``group``'s blocks in state mode ``mode`` (style.py enters it);
    ``site`` names the parallelized module for the ranks' agreement checks (checks.py)."""
    _ACTIVE.append((group, mode, site))
    try:
        yield
    finally:
        _ACTIVE.pop()


def active() -> Any:
    """(group, mode, site) of the innermost parallelized forward running, or None."""
    return _ACTIVE[-1] if _ACTIVE else None
