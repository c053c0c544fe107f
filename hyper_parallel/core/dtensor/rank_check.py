"""Cross-rank agreement checks on tensor metadata (ndim, dtype, shape).

A rank whose tensor has another ndim or dtype than its peers would otherwise reach a data
collective with a differently sized buffer: gloo aborts the process, or worse, the bytes are
reinterpreted. The check therefore sends a message of a *fixed* length, whatever the tensor: a few
header fields and the shape padded to ``MAX_DIMS`` (dims beyond that are folded into one checksum
field). Each field and its negation are min-reduced over the mesh, so every rank learns the
smallest and the largest value of every field and all ranks take the same decision.
"""
import zlib

from hyper_parallel.platform import get_platform

MAX_DIMS = 8
_DTYPE_NAMES = ("float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8",
                "uint8", "bool", "complex64", "complex128")
_UNKNOWN = 1000


def dtype_name(dtype):
    """``torch.float32`` / MindSpore ``Float32`` -> ``float32``."""
    name = str(dtype).lower()
    return name.split(".")[-1]


def dtype_code(dtype):
    name = dtype_name(dtype)
    if name in _DTYPE_NAMES:
        return _DTYPE_NAMES.index(name)
    # crc32, not hash(): it must be the same number in every process
    return _UNKNOWN + zlib.crc32(name.encode()) % (1 << 30)


def _code_name(code):
    return _DTYPE_NAMES[code] if 0 <= code < len(_DTYPE_NAMES) else f"<dtype #{code}>"


def shape_fields(shape):
    """``MAX_DIMS + 1`` ints: the dims (-1 where the tensor has fewer) and a checksum of the rest."""
    dims = [int(s) for s in shape]
    head = dims[:MAX_DIMS] + [-1] * (MAX_DIMS - min(len(dims), MAX_DIMS))
    tail = zlib.crc32(repr(dims[MAX_DIMS:]).encode()) % (1 << 30) if len(dims) > MAX_DIMS else 0
    return head + [tail]


def mesh_min_max(mesh, values, device=None):
    """(mins, maxs) of the int list ``values`` over every rank of ``mesh``: one small all-reduce
    per mesh dim, counted as ``shape_check``."""
    platform = get_platform()
    both = platform.tensor([int(v) for v in values] + [-int(v) for v in values], device=device)
    for m in range(mesh.ndim):
        both = platform.all_reduce(both, mesh.get_group(m), "min", tag="shape_check")
    both = [int(v) for v in both.tolist()]
    n = len(values)
    return both[:n], [-v for v in both[n:]]


def meta_fields(tensor):
    """[ndim, dtype code, shape fields...] of a local tensor."""
    return [len(tensor.shape), dtype_code(tensor.dtype)] + shape_fields(tensor.shape)


def describe_disagreement(names, mins, maxs):
    """``ndim 2 vs 3, dtype float32 vs float64, dim 1: 6 vs 7`` for the fields that differ."""
    parts = []
    for name, lo, hi in zip(names, mins, maxs):
        if lo == hi:
            continue
        if name == "dtype":
            parts.append(f"dtype {_code_name(lo)} vs {_code_name(hi)}")
        elif name.startswith("dim "):
            show = [("absent" if v < 0 else str(v)) for v in (lo, hi)]
            parts.append(f"{name}: {show[0]} vs {show[1]}")
        elif name == "tail":
            parts.append(f"the dims beyond dim {MAX_DIMS - 1}")
        else:
            parts.append(f"{name} {lo} vs {hi}")
    return ", ".join(parts)


def meta_field_names(prefix=""):
    return ["ndim", "dtype"] + [f"{prefix}dim {d}" for d in range(MAX_DIMS)] + ["tail"]


def check_same_meta(tensor, mesh, who, fix):
    """ValueError on every rank of ``mesh`` unless every rank's ``tensor`` has the same ndim, dtype
    and shape (one small collective per mesh dim)."""
    mine = meta_fields(tensor)
    mins, maxs = mesh_min_max(mesh, mine, getattr(tensor, "device", None))
    if mins == maxs:
        return
    rank = get_platform().get_rank()
    raise ValueError(f"{who}: the ranks of {mesh} pass tensors that differ ("
                     f"{describe_disagreement(meta_field_names(), mins, maxs)}); rank {rank} has "
                     f"{dtype_name(tensor.dtype)} {tuple(int(s) for s in tensor.shape)}. {fix}")
