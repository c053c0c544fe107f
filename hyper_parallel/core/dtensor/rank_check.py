"""Cross-rank agreement checks on tensor metadata (ndim, dtype, shape) and, in debug mode, values.

A rank whose tensor has another ndim or dtype than its peers would otherwise reach a data
collective with a differently sized buffer: gloo aborts the process, or worse, the bytes are
reinterpreted. The check therefore sends a message of a *fixed* length, whatever the tensor: a few
header fields and the shape padded to ``MAX_DIMS`` (dims beyond that are folded into one checksum
field). Each field and its negation are min-reduced over the mesh, so every rank learns the
smallest and the largest value of every field and all ranks take the same decision.

When it runs (``DTensor.from_local``): with ``run_check=True`` on every call; otherwise on the
first call of each signature (mesh, placements, shape=, local shape, dtype) in this process, so a
training loop that repeats its shapes adds no collective and no host sync. ``HP_DTENSOR_DEBUG=1``
checks every call and also compares the values of Replicate pieces. What the signature cache gives
up: a rank that passes a signature it has already verified while a peer passes a new one (say a
sequence that splits evenly in one step and unevenly in the next) is not caught without debug mode.
Meta tensors are checked by shape and dtype alone: their message lives on the mesh's device.
"""
from typing import Any, Iterator
import contextlib
import os
import threading
import zlib

import numpy as np

from hyper_parallel.core.bounded_cache import BoundedCache
from hyper_parallel.platform import get_platform

DEBUG_ENV = "HP_DTENSOR_DEBUG"
MAX_DIMS = 8
_DTYPE_NAMES = ("float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8",
                "uint8", "bool", "complex64", "complex128")
_UNKNOWN = 1000


def dtype_name(dtype: Any) -> Any:
    """``torch.float32`` / MindSpore ``Float32`` -> ``float32``."""
    name = str(dtype).lower()
    return name.split(".")[-1]


def dtype_code(dtype: Any) -> Any:
    name = dtype_name(dtype)
    if name in _DTYPE_NAMES:
        return _DTYPE_NAMES.index(name)
    # crc32, not hash(): it must be the same number in every process
    return _UNKNOWN + zlib.crc32(name.encode()) % (1 << 30)


def _code_name(code):
    return _DTYPE_NAMES[code] if 0 <= code < len(_DTYPE_NAMES) else f"<dtype #{code}>"


def shape_fields(shape: Any) -> Any:
    """``MAX_DIMS + 1`` ints: the dims (-1 where the tensor has fewer) and a checksum of the rest."""
    dims = [int(s) for s in shape]
    head = dims[:MAX_DIMS] + [-1] * (MAX_DIMS - min(len(dims), MAX_DIMS))
    tail = zlib.crc32(repr(dims[MAX_DIMS:]).encode()) % (1 << 30) if len(dims) > MAX_DIMS else 0
    return head + [tail]


def mesh_min_max(mesh: Any, values: Any, device: Any = None) -> Any:
    """(mins, maxs) of the int list ``values`` over every rank of ``mesh``: one small all-reduce
    per mesh dim, counted as ``shape_check``."""
    platform = get_platform()
    both = platform.tensor([int(v) for v in values] + [-int(v) for v in values], device=device)
    for m in range(mesh.ndim):
        both = platform.all_reduce(both, mesh.get_group(m), "min", tag="shape_check")
    if platform.is_fake(both):
        # a dry run (hyper_parallel.plan) is one rank on fake tensors: the message travels as in a
        # real run (same collectives and bytes) but agreement cannot be checked, so it is assumed
        return [int(v) for v in values], [int(v) for v in values]
    both = [int(v) for v in both.tolist()]
    n = len(values)
    return both[:n], [-v for v in both[n:]]


def meta_fields(tensor: Any) -> Any:
    """[ndim, dtype code, shape fields...] of a local tensor."""
    return [len(tensor.shape), dtype_code(tensor.dtype)] + shape_fields(tensor.shape)


def describe_disagreement(names: Any, mins: Any, maxs: Any) -> str:
    """``ndim 2 vs 3, dtype float32 vs float64, dim 1: 6 vs 7`` for the fields that differ."""
    parts = []
    for name, lo, hi in zip(names, mins, maxs):
        if lo == hi:
            continue
        if name == "dtype":
            parts.append(f"dtype {_code_name(lo)} vs {_code_name(hi)}")
        elif "dim " in name:  # "dim 1", "global dim 1"
            show = [("absent" if v < 0 else str(v)) for v in (lo, hi)]
            parts.append(f"{name}: {show[0]} vs {show[1]}")
        elif name == "tail":
            parts.append(f"the dims beyond dim {MAX_DIMS - 1}")
        else:
            parts.append(f"{name} {lo} vs {hi}")
    return ", ".join(parts)


def meta_field_names(prefix: str = "") -> Any:
    return ["ndim", "dtype"] + [f"{prefix}dim {d}" for d in range(MAX_DIMS)] + ["tail"]


def check_same_meta(tensor: Any, mesh: Any, who: Any, fix: Any) -> None:
    """ValueError on every rank of ``mesh`` unless every rank's ``tensor`` has the same ndim, dtype
    and shape (one small collective per mesh dim)."""
    mine = meta_fields(tensor)
    mins, maxs = mesh_min_max(mesh, mine, check_device(tensor, mesh))
    if mins == maxs:
        return
    rank = get_platform().get_rank()
    raise ValueError(f"{who}: the ranks of {mesh} pass tensors that differ ("
                     f"{describe_disagreement(meta_field_names(), mins, maxs)}); rank {rank} has "
                     f"{dtype_name(tensor.dtype)} {tuple(int(s) for s in tensor.shape)}. {fix}")


# ---------------------------------------------------------------------- when to check
CHECK_RANKS_ENV = "HP_CHECK_RANKS"


def check_every() -> bool:
    """``HP_CHECK_RANKS=every``: every cross-rank check runs on every call (core/agreement.py and
    this module's; unset or ``first``: at the first call of each signature)."""
    value = os.environ.get(CHECK_RANKS_ENV, "").strip().lower()
    if value in ("", "first", "default"):
        return False
    if value in ("every", "all", "1", "on", "true", "yes"):
        return True
    raise ValueError(f"{CHECK_RANKS_ENV}={value!r} is not understood: set it to 'every' (check that the "
                     f"ranks agree on every call) or unset it (check at the first call of each signature)")


def debug_checks() -> Any:
    """``HP_DTENSOR_DEBUG=1`` or ``HP_CHECK_RANKS=every``: check on every call and compare Replicate
    values (a tensor-parallel input that differs per rank; docs/dtensor.md)."""
    return os.environ.get(DEBUG_ENV, "").strip().lower() in ("1", "true", "yes", "on") or check_every()


_VERIFIED = BoundedCache(4096)


def needs_check(key: Any) -> Any:
    """Whether a call with this signature must run the cross-rank check: always in debug mode, else
    only until it has passed once in this process (``mark_verified``)."""
    return debug_checks() or key not in _VERIFIED


def mark_verified(key: Any) -> None:
    # marked only after the check passed on every rank, so a call that raised is checked again
    _VERIFIED.add(key)


def is_meta(tensor: Any) -> bool:
    return bool(getattr(tensor, "is_meta", False))


def check_device(tensor: Any, mesh: Any) -> Any:
    """Where the check's small message lives: the tensor's device, except for a meta tensor, which
    has no data to read back: then the mesh's device."""
    if is_meta(tensor):
        return None if mesh.device_type in (None, "meta") else mesh.device_type
    return getattr(tensor, "device", None)


# ---------------------------------------------------------------------- naming the caller
_CALLER = threading.local()


@contextlib.contextmanager
def describing(who: Any, uneven_fix: Any = None) -> Iterator[None]:
    """Name the caller in the check's messages (a style's hook: ``SequenceParallel(sequence_dim=1)
    input of LayerNorm``) and, with ``uneven_fix``, say how to fix pieces of unequal size in its terms."""
    stack = _CALLER.__dict__.setdefault("stack", [])
    stack.append((who, uneven_fix))
    try:
        yield
    finally:
        stack.pop()


def _caller(default_who):
    stack = getattr(_CALLER, "stack", None)
    return stack[-1] if stack else (default_who, None)


# ---------------------------------------------------------------------- from_local's pieces
def _placements_code(placements):
    return zlib.crc32(repr(tuple(placements)).encode()) % (1 << 30)


def check_pieces(local: Any, mesh: Any, placements: Any, spec: Any, shape_given: Any, problem: Any = None,
                 who: str = "DTensor.from_local") -> None:
    """ValueError on every rank of ``mesh`` unless the ranks' ``local`` pieces have one ndim and
    dtype, the same placements, agree on the global shape (``spec.shape``: given or inferred) and
    each piece is the one the layout gives its rank. ``spec`` is None and ``problem`` the error
    when the placements did not fit this rank's tensor: raised on every rank once the ranks are
    known to agree (a rank that raised alone would leave its peers waiting in a collective)."""
    try:
        fits = int(spec is not None and tuple(int(s) for s in local.shape) == spec.local_shape)
    except (IndexError, ValueError):
        fits = 0
    global_shape = spec.shape if spec is not None else tuple(local.shape)
    # normalised when they fit (Shard(-1) on one rank equals Shard(1) on another)
    code = _placements_code(spec.placements if spec is not None else placements)
    mine = [fits, len(local.shape), dtype_code(local.dtype), code]
    mins, maxs = mesh_min_max(mesh, mine + shape_fields(global_shape), check_device(local, mesh))
    if mins == maxs and fits:
        return
    if problem is not None and mins[1:] == maxs[1:]:
        raise problem
    raise ValueError(_pieces_message(local, mesh, spec, placements, shape_given, mins, maxs, who))


def _pieces_message(local, mesh, spec, placements, shape_given, mins, maxs, who):
    who, uneven_fix = _caller(who)
    names = ["", "ndim", "dtype", "placements"] + meta_field_names("global ")[2:]
    differ = describe_disagreement(names[1:], mins[1:], maxs[1:])
    if mins[1] != maxs[1] or mins[2] != maxs[2]:
        lead, fix = (f"the ranks pass local tensors that differ ({differ})",
                     "Every rank passes its piece of one tensor: the same ndim and dtype everywhere")
    elif mins[3] != maxs[3]:
        lead, fix = ("the ranks pass different placements", "Pass the same placements on every rank")
    elif not shape_given and mins[4:] != maxs[4:]:
        lead = (f"the local pieces differ in size, so the global shape (piece x mesh size) differs "
                f"between ranks ({differ})")
        fix = uneven_fix or ("For uneven shards pass the global shape= on every rank (pieces follow "
                             "torch.chunk: earlier ranks hold the larger ones)")
    elif mins[4:] != maxs[4:]:
        lead, fix = f"the ranks pass different shape= ({differ})", "Pass the same shape= on every rank"
    else:
        where = f"the global {list(spec.shape)}" if spec is not None else "the tensor"
        lead = f"some rank's piece is not its piece of {where} laid out as {tuple(placements)}"
        fix = uneven_fix or ("Pass each rank its torch.chunk piece (earlier ranks hold the larger ones) "
                             "and the global shape= on every rank")
    rank = get_platform().get_rank()
    expected = ""
    if spec is not None:
        try:
            expected = f" (its piece of {list(spec.shape)} is {spec.local_shape})"
        except (IndexError, ValueError):
            expected = ""
    return (f"{who}: on {mesh}, {lead}; rank {rank} has {dtype_name(local.dtype)} "
            f"{tuple(int(s) for s in local.shape)}{expected}. {fix}")


# ---------------------------------------------------------------------- Replicate values
def check_replicated_values(local: Any, mesh: Any, placements: Any) -> None:
    """Debug mode: ValueError on every rank of ``mesh`` unless the piece is the same on every rank
    of each mesh dim it is replicated over (``Replicate`` in ``placements``), naming the largest
    difference. Two all-reduces of the piece per such dim: for debugging only."""
    platform = get_platform()
    dims = [m for m, p in enumerate(placements) if p.is_replicate()]
    if not dims or is_meta(local):
        return
    x = platform.detach(local).double().reshape(-1)
    nan = x != x
    # NaN flags travel beside the values (a NaN never equals itself, but equal flags agree)
    x = platform.cat([x.masked_fill(nan, 0.0), nan.double()])
    worst = 0.0
    if int(x.numel()):
        for m in dims:
            group = mesh.get_group(m)
            hi = platform.all_reduce(x, group, "max", tag="replicate_check")
            lo = platform.all_reduce(x, group, "min", tag="replicate_check")
            # equal infinities agree (inf - inf would be NaN)
            worst = max(worst, float((hi - lo).masked_fill(hi == lo, 0.0).max()))
    # one more reduce over the whole mesh: a disagreement on one line must stop every rank
    worst_all = platform.tensor([worst], device=check_device(local, mesh))
    for m in range(mesh.ndim):
        worst_all = platform.all_reduce(worst_all, mesh.get_group(m), "max", tag="replicate_check")
    worst = float(worst_all.tolist()[0])
    if worst == 0:
        return
    who, _ = _caller("DTensor.from_local")
    what = f"max difference {worst:.6g}" + (" (an inf on some ranks)" if worst == float("inf") else "")
    raise ValueError(f"{who}: a piece laid out as {tuple(placements)} on {mesh} is replicated over mesh "
                     f"dim(s) {dims} but differs between those ranks ({what}; {DEBUG_ENV}=1 or "
                     f"{CHECK_RANKS_ENV}=every compares them); rank {get_platform().get_rank()} has "
                     f"{dtype_name(local.dtype)} {tuple(int(s) for s in local.shape)}. Give every rank the "
                     f"same value (same seed, same data), or declare the input Shard/Partial if it really "
                     f"differs per rank")


def broadcast_replicated(local: Any, mesh: Any, placements: Any) -> Any:
    """``from_local(run_check=True)`` as in PyTorch: on each mesh dim the piece is replicated over,
    every rank takes the value of the first rank of its line (differentiable as the identity)."""
    platform = get_platform()
    dims = [m for m, p in enumerate(placements) if p.is_replicate()]
    if not dims or is_meta(local):
        return local
    grid = np.asarray(mesh.rank_list).reshape(mesh.mesh_shape)
    me = list(mesh.get_coordinate())
    value = platform.detach(local)
    for m in dims:
        value = platform.broadcast(value, int(grid[tuple(me[:m] + [0] + me[m + 1:])]), mesh.get_group(m))
    if platform.is_grad_enabled() and platform.requires_grad(local):
        # gradients flow to ``local`` as through from_local; only the values are the first rank's
        return local + (value - platform.detach(local))
    return value
