"""What context parallelism promises the attention kernel it wraps, checked where the kernel runs.

ContextParallel splits q, k, v along the dims its ``seq_dim`` / ``head_dim`` name, then runs the
user's module, which may transpose them before ``scaled_dot_product_attention``. If those dims do
not name q's sequence and heads (BNSD dims on BSHD blocks, ``seq_dim=0``), the kernel is handed a
consistent but different tensor — each rank's heads or batch rows taken for the sequence — and the
result is another attention with no error. The kernel is the one place that knows which of its dims
is the sequence (dim -2) and which the heads (dim -3), so the CP call states what the kernel must
receive on each CP mesh dim (the sequence split for all-gather KV, the heads split for Ulysses) and
the global query length, and the sdpa rule raises when q arrives otherwise.

Shapes cannot always tell: with seq_dim=0 on BSHD blocks of batch B, Ulysses hands the kernel a
"sequence" of B·P rows, which equals the local sequence length when B·P == S_local. So the sequence
dim is also *tracked*: the CP call states which dim of q, k, v is its sequence, and a dispatch
interceptor (``SeqTracking``) carries that dim through every relayout the module applies
(transpose, permute, movedim, view / reshape / flatten / unflatten, expand, contiguous, casts, and
pointwise ops and norms such as a scale or RoPE) to the kernel: ``F.scaled_dot_product_attention``
and ``hyper_parallel.attention`` take the sequence at dim -2, ``npu_fusion_attention`` at its
layout's S dim. Anywhere else is a ValueError naming seq_dim, the kernel dim it reached and the fix,
raised identically on every rank (shapes and ops are the same everywhere) before the kernel runs.
The ring and mask interceptors track as they follow; in the other modes ``tracking`` pushes a
tracker that only watches, once per call signature (later calls of the signature run untouched:
the decision cache and fast path stay in charge, no host sync, no collective).

Given up: attention written with matmul / softmax has no kernel to check; such modules rely on the
dims being right. A dim merged with another (flattening the sequence into the batch) or split is no
longer one dim, so it is not followed further. A sharding decision cached from an earlier call of
the same signature outside any CP call skips the role check (the decision cache keys on placements
and shapes, not on this state). During the watched first call, views of q/k/v are taken by the
interceptor path (as in ring mode), so an in-place write through such a view is not refused there.
The watch is once per (style object, mesh, q/k/v shapes and layouts): one style applied to modules
that relay q/k/v differently is watched in the first of them only (outside the ring / masked modes).
"""
import contextlib
from dataclasses import dataclass
from typing import Any, Hashable, Iterable, Iterator, Optional

from hyper_parallel.core.bounded_cache import BoundedCache, IdentityTable
from hyper_parallel.core.dtensor.dispatch.interceptors import Interceptor, intercepting
from hyper_parallel.core.attention.npu_args import LAYOUTS, NpuAttentionArgs
from hyper_parallel.core.dtensor.ops.view import _permutation, reshape_groups

_ACTIVE: list = []


@dataclass(frozen=True)
class AttentionRoles:
    mesh: object
    roles: tuple        # (mesh dim, "seq" | "heads") for every CP mesh dim
    q_length: int       # the global query sequence length
    label: str          # the style, for messages


@contextlib.contextmanager
def expecting(roles: Any) -> Iterator[None]:
    _ACTIVE.append(roles)
    try:
        yield
    finally:
        _ACTIVE.pop()


def check_query(spec: Any) -> None:
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


# ------------------------------------------------------------------ the sequence dim, tracked
_QKV = ("query", "key", "value")
_KERNELS = frozenset({"sdpa", "attention", "npu_fusion_attention"})
_PERMUTES = frozenset({"transpose", "permute", "movedim", "t"})
_IN_PLACE = frozenset({"elementwise", "dropout", "layer_norm", "rms_norm"})
_SDPA_DIMS = {4: ("batch", "heads", "sequence", "head-size"), 3: ("heads", "sequence", "head-size")}


def moved_dim(call: Any, dim: int, in_shape: tuple, out_shape: tuple) -> Optional[int]:
    """Where dim ``dim`` of the op's input (global ``in_shape``) is in its output (``out_shape``);
    None where it is no longer one whole dim (merged with another, split, or an op that moves data
    across dims)."""
    name = call.name
    if name in _PERMUTES:
        return _permutation(call, len(in_shape)).index(dim)
    if name in ("identity", "cast", "contiguous"):
        return dim
    if name == "expand":
        lead = len(out_shape) - len(in_shape)
        return dim + lead if out_shape[dim + lead] == in_shape[dim] else None
    if name == "view":
        if in_shape[dim] == 1:
            return None
        for gi, gj in reshape_groups(tuple(in_shape), tuple(out_shape)):
            if dim in gi:
                return gj[0] if len(gi) == 1 and len(gj) == 1 else None
        return None
    # a pointwise op or a norm keeps every dim in place (a scale, RoPE's products, a q/k norm);
    # others may reorder dims even where the shape stays (einsum "bshd->bhsd" with S == H)
    return dim if name in _IN_PLACE and tuple(out_shape) == tuple(in_shape) else None


def _kernel_seq(call: Any, tensor: Any) -> tuple:
    """(the kernel's sequence dim for ``tensor``, names of the kernel's dims) for a q/k/v argument."""
    ndim = len(tensor.shape)
    if call.name == "npu_fusion_attention":
        layout = str(NpuAttentionArgs(call.args, call.kwargs)["input_layout"]).upper()
        if layout not in LAYOUTS:
            return None, ()
        batch, seq, head, packed = LAYOUTS[layout]
        names = [""] * ndim
        for d, what in ((batch, "batch"), (seq, "sequence"), (head, "hidden" if packed else "heads")):
            if d is not None and d < ndim:
                names[d] = what
        return seq, tuple(n or "head-size" for n in names)
    return ndim - 2, _SDPA_DIMS.get(ndim, ("leading",) * (ndim - 2) + ("sequence", "head-size"))


class SeqTracking(Interceptor):
    """A CP interceptor that follows q, k, v with their sequence dim (``track``), carries it
    through the relayouts the dispatcher reports (``passed``) and checks it at the kernel
    (``check_kernel``). ``keep_all``: keep following outputs whose sequence dim was lost (the ring
    and mask interceptors refuse ops on tensors they stop following)."""
    keep_all = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._seq = IdentityTable()   # tensor -> sequence dim (None: unknown)
        self.label = "ContextParallel"

    def track(self, tensors: Iterable, seq: Optional[int], label: str) -> None:
        self.label = label
        for t in tensors:
            self.follow(t, seq)

    def follow(self, tensor: Any, seq: Optional[int] = None) -> None:
        super().follow(tensor)
        self._seq[tensor] = seq

    def seq_of(self, tensor: Any) -> Optional[int]:
        return self._seq.get(tensor) if self.follows(tensor) else None

    def passed(self, call: Any, inputs: list, outputs: list) -> None:
        if call.name in _KERNELS:
            return
        first = call.args[0] if call.args else None
        src = first if self.follows(first) else next((x for x in inputs if self.follows(x)), None)
        if src is None:
            return
        dim = self.seq_of(src)
        for out in outputs:
            new = None if dim is None else moved_dim(call, dim, tuple(src.shape), tuple(out.shape))
            if new is not None or self.keep_all:
                self.follow(out, new)

    def check_kernel(self, call: Any) -> None:
        """ValueError unless every tracked q/k/v reaches the kernel with the sequence where the
        kernel takes it."""
        for i, name in enumerate(_QKV):
            t = call.arg(i, name)
            dim = self.seq_of(t) if t is not None else None
            if dim is None:
                continue
            want, names = _kernel_seq(call, t)
            if want is None or dim == want:
                continue
            raise ValueError(
                f"{self.label}: seq_dim names a dim of {name} that reaches the attention kernel "
                f"({_KERNEL_NAMES[call.name]}, {name} of shape {tuple(t.shape)}) as the kernel's "
                f"{names[dim]} dim {dim}, not its sequence dim {want}: the module relays q/k/v out so "
                f"that seq_dim/head_dim are not their sequence and head dims. Use seq_dim=1, head_dim=2 "
                f"for BSHD blocks (batch, seq, heads, dim) or seq_dim=2, head_dim=1 for BNSD blocks "
                f"(batch, heads, seq, dim)")


_KERNEL_NAMES = {"sdpa": "F.scaled_dot_product_attention", "attention": "hyper_parallel.attention",
                 "npu_fusion_attention": "npu_fusion_attention"}


class _Everything(frozenset):
    """Every op name (a watching tracker passes every op on and refuses none)."""

    def __contains__(self, name: object) -> bool:
        return True


class SeqTracker(SeqTracking):
    """Only watches: every op passes (outputs followed while their sequence dim is known), the
    kernel is checked and then left to its rule."""
    pass_through = _Everything()
    consumers = _KERNELS
    keep_all = False

    def strategy(self, call: Any) -> None:
        self.check_kernel(call)
        return None


_WATCHED = BoundedCache(4096)


@contextlib.contextmanager
def tracking(key: Hashable, tensors: Iterable, seq: int, label: str) -> Iterator[None]:
    """Watch ``tensors`` (sequence at ``seq``) to the attention kernel, once per ``key`` (a call
    signature): later calls with the key run unwatched. A call that raised is watched again."""
    if key in _WATCHED:
        yield
        return
    tracker = SeqTracker()
    tracker.track(tensors, seq, label)
    with intercepting(tracker):
        yield
    _WATCHED[key] = True
