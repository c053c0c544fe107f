"""What ContextParallel checks before it moves any data.

First one small all-reduce (one per CP mesh dim, tag "shape_check") tells every rank whether all
ranks passed q, k, v of one ndim, dtype and shape; only then are the per-rank checks safe, because
they see the same shapes everywhere and so raise the same ValueError on every rank. A rank that
raised alone would leave the others waiting in the first data collective.

The length rule: each of q, k, v is split along the sequence over the CP ranks, so each has ONE
local length on every rank (checked across ranks), k and v have the same length and heads, and
q's length may differ from k/v's (cross-attention, TND packs with other key lengths): every mode
but the ring handles that. The ring pairs q block i with k/v block i (causal skip / diagonal,
zigzag chunk ids), so it needs equal lengths. A plain k/v holding the whole sequence beside a CP
q (a "guess" the style must not make) has the ambiguous length cp x q's block; it is told apart
from a genuine longer block by its content: the same k/v on every rank is the whole sequence.
"""
from typing import Any
import os
import zlib

from hyper_parallel.core.bounded_cache import BoundedCache, lifetime_key
from hyper_parallel.platform import get_platform

NAMES = ("q", "k", "v")
_SLOTS = 6  # dims compared one by one; the product of any further dims shares the last slot
_WIDTH = 2 + _SLOTS
_LAYOUT_HINT = "use seq_dim=1, head_dim=2 for BSHD (batch, seq, heads, dim), seq_dim=2, head_dim=1 for BNSD"


def _signature(t):
    shape = [int(s) for s in t.shape]
    dims = shape[:_SLOTS] + [-1] * (_SLOTS - len(shape))
    if len(shape) > _SLOTS:
        rest = 1
        for s in shape[_SLOTS - 1:]:
            rest *= s
        dims[-1] = rest
    # a stable code for the dtype: equal names give equal codes on every rank
    return [len(shape), zlib.crc32(str(t.dtype).encode()) & 0xFFFFFF] + dims


def fingerprint(t: Any) -> Any:
    """A positive int equal on ranks holding equal data (and almost surely different otherwise);
    only taken for the ambiguous "whole sequence or a longer block?" plain k/v (see
    suspect_whole_sequence), so it costs nothing in the usual case."""
    x = t.detach().reshape(-1).float()
    x = x.nan_to_num(nan=0.5, posinf=0.25, neginf=-0.25)
    parts = (float(x.sum()), float((x * x).sum()), float(x[::7].sum()), float(x[:1].sum()),
             float(x[-1:].sum()))
    return 1 + (zlib.crc32(repr(parts).encode()) & 0x3FFFFFFF)


def suspect_whole_sequence(style: Any, qkv: Any, raw: Any, q_block: Any, cp_size: Any) -> Any:
    """Fingerprints (0 = not taken) of plain k/v whose local length is cp_size x q's block: the
    one length at which a plain k/v may be the whole sequence rather than this rank's block."""
    from hyper_parallel.core.dtensor.dtensor import DTensor
    prints = [0, 0, 0]
    ndim = raw[0].ndim
    if cp_size == 1 or q_block is None or not -ndim <= style.seq_dim < ndim:
        return prints
    seq = style.seq_dim % ndim
    for i in (1, 2):
        t = qkv[i]
        if (not isinstance(t, DTensor) and t.ndim == ndim and int(t.shape[seq]) == cp_size * q_block
                and int(t.numel()) > 0):
            prints[i] = fingerprint(t)
    return prints


_VERIFIED = BoundedCache(4096)


def debug_checks() -> Any:
    from hyper_parallel.core.dtensor.rank_check import check_every
    return os.environ.get("HP_CP_DEBUG", "").strip().lower() in ("1", "true", "yes", "on") or check_every()


def first_call_of_signature(style: Any, cp_mesh: Any, qkv: Any) -> bool:
    """Whether this call's inputs need the cross-rank check: the first call with their shapes,
    dtypes and layouts (per style and mesh), or every call with ``HP_CP_DEBUG=1``. A training loop
    repeats a few signatures, so the steady state adds no collective and no host sync. What is given
    up: ranks that disagree only after this rank has verified its own signature are not caught
    here but by the attention's collectives (a collective error or timeout, see init_device_mesh's
    ``timeout=``); debug mode catches them with a ValueError."""
    from hyper_parallel.core.dtensor.dtensor import DTensor
    if debug_checks():
        return True
    key = (lifetime_key(style), cp_mesh,
           tuple((tuple(t.shape), t.dtype, t.placements if isinstance(t, DTensor) else None) for t in qkv))
    if key in _VERIFIED:
        return False
    _VERIFIED.add(key)
    return True


def check_across_ranks(cp_mesh: Any, tensors: Any, prints: Any = (0, 0, 0)) -> Any:
    """Raise the same ValueError on every CP rank unless all ranks passed equal signatures.
    Returns, per tensor, whether its fingerprint (``prints``, 0 = none) is the same on every rank."""
    platform = get_platform()
    signature = []
    for t in tensors:
        signature.extend(_signature(t))
    signature.extend(int(p) for p in prints)
    probe = platform.tensor(signature + [-x for x in signature])
    for m in range(cp_mesh.ndim):
        probe = platform.all_reduce(probe, cp_mesh.get_group(m), "max", tag="shape_check")
    # a dry run (hyper_parallel.plan, fake tensors) cannot read the peers' answer: agreement assumed
    values = (signature + [-x for x in signature] if platform.is_fake(probe)
              else [int(x) for x in probe.tolist()])
    top, bottom = values[:len(signature)], [-x for x in values[len(signature):]]
    n = len(tensors) * _WIDTH
    if top[:n] == bottom[:n]:
        return [p > 0 and hi == lo for p, hi, lo in zip(prints, top[n:], bottom[n:])]
    for i, name in enumerate(NAMES[:len(tensors)]):
        hi, lo = top[i * _WIDTH:(i + 1) * _WIDTH], bottom[i * _WIDTH:(i + 1) * _WIDTH]
        if hi[0] != lo[0]:
            raise ValueError(f"ContextParallel: ranks passed {name} with different numbers of dims ({lo[0]} "
                             f"on one rank, {hi[0]} on another; this rank: {tuple(tensors[i].shape)}); every "
                             f"rank must pass its block of the same tensor")
        if hi[1] != lo[1]:
            raise ValueError(f"ContextParallel: ranks passed {name} of different dtypes (this rank: "
                             f"{tensors[i].dtype}); cast q, k and v to one dtype on every rank")
        if hi != lo:
            n = min(hi[0], _SLOTS)
            raise ValueError(f"ContextParallel: ranks passed {name} blocks of different shapes (per-dim max "
                             f"{hi[2:2 + n]}, min {lo[2:2 + n]}); every rank must pass an equal contiguous "
                             f"block of the sequence (pad the sequence to a multiple of the CP size)")


def normalise_dims(style: Any, ndims: Any) -> Any:
    """(seq, head) as dims in [0, ndim) of q/k/v; only negative dims wrap."""
    if len(set(ndims)) != 1:
        raise ValueError(f"ContextParallel: q, k and v must have the same number of dims, got "
                         f"{dict(zip(NAMES, ndims))}")
    ndim = ndims[0]
    dims = []
    for name, d in (("seq_dim", style.seq_dim), ("head_dim", style.head_dim)):
        if not -ndim <= d < ndim:
            raise ValueError(f"ContextParallel: {name}={d} is out of range for {ndim}-dim q/k/v (valid "
                             f"{-ndim}..{ndim - 1}); {_LAYOUT_HINT}")
        dims.append(d + ndim if d < 0 else d)
    if dims[0] == dims[1]:
        raise ValueError(f"ContextParallel: seq_dim={style.seq_dim} and head_dim={style.head_dim} are the "
                         f"same dim {dims[0]} of {ndim}-dim q/k/v; {_LAYOUT_HINT}")
    return tuple(dims)


def _problem(shapes, seq, head, equal_lengths=None):
    """Why q/k/v of these (per-CP-rank block) shapes cannot be attention inputs with these dims.
    ``equal_lengths``: why the mode needs q and k/v of one length (None: they may differ)."""
    q, k, v = shapes
    if q[seq] == 0:
        return (f"the local sequence block is empty (q has 0 tokens on dim {seq}); every rank needs at least "
                f"one token: make the global sequence at least the CP size (pad it to a multiple of it)")
    if (k[seq], k[head]) != (v[seq], v[head]):
        return (f"k {k} and v {v} differ on the sequence dim {seq} or the head dim {head}; they must "
                f"hold the same tokens and heads")
    if k[seq] == 0:
        return (f"the local k/v block is empty (k has 0 tokens on dim {seq}); every rank needs at least "
                f"one key: pad the key sequence to a multiple of the CP size")
    if equal_lengths and q[seq] != k[seq]:
        return (f"q {q} has {q[seq]} tokens on the sequence dim {seq} but k/v {k} have {k[seq]}; "
                f"{equal_lengths}, so q and k/v need the same length")
    if k[head] == 0 or q[head] % k[head]:
        return (f"q has {q[head]} heads on the head dim {head} and k/v have {k[head]}: the k/v heads must "
                f"divide the q heads (GQA)")
    return None


def _equal_lengths(style, cp_size):
    """Why this mode needs q and k/v of one local length, or None."""
    if style.kv_exchange == "ring" and cp_size > 1:
        what = "zigzag chunk ids" if style.load_balance else "the causal skip / diagonal of each block pair"
        return (f"kv_exchange='ring' pairs q block i with k/v block i ({what}); use "
                f"kv_exchange='allgather' for q and k/v of different lengths")
    return None


def check_layout(style: Any, shapes: Any, seq: Any, head: Any, cp_size: int = 1) -> None:
    """A ValueError when the shapes contradict seq_dim/head_dim, suggesting the layout they fit.
    q and k/v may differ in length (each split over the ranks) unless the mode needs them equal.

    Given up: with lengths free, dims swapped on self-attention data (BNSD dims on BSHD q/k/v with
    GQA, say) read as a valid cross-attention (the heads as lengths) and cannot be told by shape;
    only where a check fails (ring, heads, k vs v) does the message name the other layout."""
    equal = _equal_lengths(style, cp_size)
    problem = _problem(shapes, seq, head, equal)
    if problem is None:
        return
    hint = ""
    if _problem(shapes, head, seq, equal) is None:
        hint = (f"; the shapes fit seq_dim={head}, head_dim={seq}: are q/k/v in the other layout "
                f"(BSHD vs BNSD)?")
    raise ValueError(f"ContextParallel(seq_dim={style.seq_dim}, head_dim={style.head_dim}): {problem}{hint}")


def check_whole_sequence(same: Any, shapes: Any, seq: Any, cp_size: Any) -> None:
    """Raise (on every rank: ``same`` came from the all-reduce) when a plain k/v of cp x q's length
    is the same tensor on every rank: the whole sequence, not this rank's block."""
    for name, hit, shape in zip(NAMES, same, shapes):
        if hit:
            raise ValueError(
                f"ContextParallel: {name} {tuple(shape)} is a plain tensor identical on every CP rank and "
                f"{cp_size} x as long as q's block ({shapes[0][seq]} tokens): it is the whole sequence, "
                f"not this rank's block, and ContextParallel does not guess. Pass this rank's block (for "
                f"self-attention the same length as q's block), or a DTensor (Replicate() for the whole "
                f"sequence)")


# ---------------------------------------------------------------------- ranks that agree (SPEC §19)
_AGREE_FIX = ("build ContextParallel with the same arguments on every rank, and call it alike everywhere "
              "(same grad mode, same attention_masks, q/k/v of one kind)")


def style_settings(style: Any) -> Any:
    """What every rank's ContextParallel must share: its mode and dims (``mode='auto'``'s options too)."""
    settings = {"mode": style.mode, "ulysses_degree": style.ulysses_degree, "kv_exchange": style.kv_exchange,
                "load_balance": bool(style.load_balance), "seq_dim": style.seq_dim,
                "head_dim": style.head_dim, "overlap": style.overlap, "chunks": style.chunks,
                "use_local_output": bool(style.use_local_output), "qkv_indices": style.qkv_indices,
                "qkv_kwarg_names": style.qkv_kwarg_names}
    if style.mode == "auto":
        settings.update(memory_budget=style.memory_budget, causal=style.causal, tune=style.tune,
                        calibration=None if style.calibration is None else "a file")
    return settings


def mask_settings(masks: Any) -> Any:
    """``attention_masks`` entered or not, its tensors' shapes, and (compared when the check runs:
    the documents change every batch) a digest of their contents. The same names with or without
    masks, so the message names the masks rather than the set of settings."""
    from hyper_parallel.core.agreement import Deferred, tensor_digest
    ids, padding = (None, None) if masks is None else (masks.document_ids, masks.padding)
    return {"attention_masks": None if masks is None else ("entered", ids is not None, padding is not None,
                                                           masks.block_size),
            "attention_masks shapes": (ids, padding),
            "attention_masks documents": Deferred(lambda: tensor_digest(ids)),
            "attention_masks padding": Deferred(lambda: tensor_digest(padding))}


def agree_on_call(style: Any, cp_mesh: Any, qkv: Any, masks: Any) -> None:
    """ValueError on every CP rank unless the ranks run this call alike: the style's settings,
    grad mode, masks, and q/k/v's kind (plain or DTensor and where) and requires_grad. One small
    message at the first call of each combination (core/agreement.py)."""
    from hyper_parallel.core.agreement import check_agreement
    from hyper_parallel.core.dtensor.dtensor import DTensor
    platform = get_platform()
    # the mesh by shape and names: its ranks differ legitimately (each CP rank's own TP group)
    kinds = tuple(f"DTensor {tuple(t.placements)} on a {t.device_mesh.mesh_shape} mesh "
                  f"{t.device_mesh.mesh_dim_names}" if isinstance(t, DTensor) else "plain" for t in qkv)
    settings = dict(style_settings(style), **mask_settings(masks))
    settings.update({"grad mode (is_grad_enabled)": bool(platform.is_grad_enabled()), "q/k/v kind": kinds,
                     "q/k/v requires_grad": tuple(bool(platform.requires_grad(t)) for t in qkv)})
    check_agreement(cp_mesh, "ContextParallel", settings, signature=lifetime_key(style), fix=_AGREE_FIX)
