"""What context parallelism promises the attention kernel it wraps, checked where the kernel runs.

ContextParallel splits q, k, v along the dims its ``seq_dim`` / ``head_dim`` name, then runs the
user's module, which may transpose them before ``scaled_dot_product_attention``. If those dims do
not name q's sequence and heads (BNSD dims on BSHD blocks, ``seq_dim=0``), the kernel is handed a
consistent but different tensor — each rank's heads or batch rows taken for the sequence — and the
result is another attention with no error. The kernel is the one place that knows which of its dims
is the sequence (dim -2) and which the heads (dim -3), so the CP call states what the kernel must
receive on each CP mesh dim (the sequence split for all-gather KV, the heads split for Ulysses) and
the global query length, and the sdpa rule raises when q arrives otherwise.

Given up: attention written with matmul / softmax has no kernel to check; such modules rely on the
dims being right. A sharding decision cached from an earlier call of the same signature outside any
CP call skips the check (the decision cache keys on placements and shapes, not on this state).
"""
import contextlib
from dataclasses import dataclass

_ACTIVE = []


@dataclass(frozen=True)
class AttentionRoles:
    mesh: object
    roles: tuple        # (mesh dim, "seq" | "heads") for every CP mesh dim
    q_length: int       # the global query sequence length
    label: str          # the style, for messages


@contextlib.contextmanager
def expecting(roles):
    _ACTIVE.append(roles)
    try:
        yield
    finally:
        _ACTIVE.pop()


def check_query(spec):
    """ValueError when the innermost CP call's promise does not hold for the kernel's q (a spec)."""
    if not _ACTIVE or spec.mesh != _ACTIVE[-1].mesh:
        return
    want = _ACTIVE[-1]
    ndim = len(spec.shape)
    dims = {"seq": ndim - 2, "heads": ndim - 3}
    for m, role in want.roles:
        placement = spec.placements[m]
        if not placement.is_shard(dims[role]) or spec.shape[ndim - 2] != want.q_length:
            raise ValueError(
                f"{want.label}: the attention kernel received q of global shape {tuple(spec.shape)} with "
                f"{placement} on CP mesh dim {m}, but this mode hands it q split along the {role} (dim "
                f"{dims[role] - ndim} of (..., heads, seq, dim)) of a {want.q_length}-token sequence: "
                f"seq_dim/head_dim do not name q/k/v's sequence and head dims as the module passes them "
                f"(seq_dim=1, head_dim=2 for BSHD blocks; seq_dim=2, head_dim=1 for BNSD)")
