"""What ContextParallel checks before it moves any data.

First one small all-reduce (one per CP mesh dim, tag "shape_check") tells every rank whether all
ranks passed q, k, v of one ndim, dtype and shape; only then are the per-rank checks safe, because
they see the same shapes everywhere and so raise the same ValueError on every rank. A rank that
raised alone would leave the others waiting in the first data collective.
"""
import zlib

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


def check_across_ranks(cp_mesh, tensors):
    """Raise the same ValueError on every CP rank unless all ranks passed equal signatures."""
    platform = get_platform()
    signature = []
    for t in tensors:
        signature.extend(_signature(t))
    probe = platform.tensor(signature + [-x for x in signature])
    for m in range(cp_mesh.ndim):
        probe = platform.all_reduce(probe, cp_mesh.get_group(m), "max", tag="shape_check")
    values = [int(x) for x in probe.tolist()]
    top, bottom = values[:len(signature)], [-x for x in values[len(signature):]]
    if top == bottom:
        return
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


def normalise_dims(style, ndims):
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


def _problem(shapes, seq, head):
    """Why q/k/v of these (per-CP-rank block) shapes cannot be attention inputs with these dims."""
    q, k, v = shapes
    if q[seq] == 0:
        return (f"the local sequence block is empty (q has 0 tokens on dim {seq}); every rank needs at least "
                f"one token: make the global sequence at least the CP size (pad it to a multiple of it)")
    if (k[seq], k[head]) != (v[seq], v[head]):
        return (f"k {k} and v {v} differ on the sequence dim {seq} or the head dim {head}; they must "
                f"hold the same tokens and heads")
    if q[seq] != k[seq]:
        return (f"q {q} has {q[seq]} tokens on the sequence dim {seq} but k/v {k} have {k[seq]}; "
                f"ContextParallel splits one sequence, so q, k and v need the same length")
    if k[head] == 0 or q[head] % k[head]:
        return (f"q has {q[head]} heads on the head dim {head} and k/v have {k[head]}: the k/v heads must "
                f"divide the q heads (GQA)")
    return None


def check_layout(style, shapes, seq, head):
    """A ValueError when the shapes contradict seq_dim/head_dim, suggesting the layout they fit."""
    problem = _problem(shapes, seq, head)
    if problem is None:
        return
    hint = ""
    if _problem(shapes, head, seq) is None:
        hint = (f"; the shapes fit seq_dim={head}, head_dim={seq}: are q/k/v in the other layout "
                f"(BSHD vs BNSD)?")
    raise ValueError(f"ContextParallel(seq_dim={style.seq_dim}, head_dim={style.head_dim}): {problem}{hint}")
