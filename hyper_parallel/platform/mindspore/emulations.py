"""Emulated collectives: what MindSpore lacks on CPU (``mccl``), built from AllGather / AllReduce.

Every emulation is exact (it moves the values, it never approximates them) but sends more bytes
than the native collective would; the bytes reported to ``CommDebugMode`` are the bytes the
emulation really sends (under the logical op's name), so the benchmark shows the difference.

Each emulation registers how it works under the collective's name in ``capabilities()``'s table
(:func:`emulation`); ``scope="cpu"`` entries apply where the native kernels are missing (CPU, or
``HP_MS_EMULATE_COLLECTIVES=1``), ``scope="always"`` ones on every backend. The platform's
``capabilities()`` reads :func:`capability_table`, so the descriptions live only here.
"""
from typing import Any
import numpy as np

import mindspore as ms
from mindspore import mint
import mindspore.mint.distributed as msdist

from hyper_parallel.platform.handles import CompletedHandle
from hyper_parallel.platform.mindspore.groups import handle, nbytes, numel, then

_REGISTRY: dict[Any, Any] = {}   # collective -> (description, scope)


def register(collective: Any, description: Any, scope: str = "cpu") -> None:
    """Describe how ``collective`` is provided where it is not plain native."""
    _REGISTRY[collective] = (description, scope)


def emulation(collective: Any, description: Any, scope: str = "cpu") -> Any:
    """Decorator: register the decorated function as the emulation of ``collective``."""
    def decorate(fn):
        register(collective, description, scope)
        return fn
    return decorate


def capability_table(native: Any, emulating: Any) -> Any:
    """``native`` (collective -> description) overridden by the registered emulations that apply
    (all of them when ``emulating``, else only the ``scope="always"`` ones)."""
    table = dict(native)
    for collective, (description, scope) in _REGISTRY.items():
        if emulating or scope == "always":
            table[collective] = description
    return table


@emulation("all_to_all_single", "emulated: all_gather of the whole tensor, keep own block "
                                "((n-1)*N bytes, n x a native all-to-all)")
def all_to_all_single(comm: Any, tensor: Any, group: Any, split_dim: Any, concat_dim: Any,
                      async_op: Any) -> Any:
    """Everyone gathers every rank's whole tensor and keeps its own block of each."""
    n, me = len(group), comm.me(group)
    comm.record("all_to_all", (n - 1) * nbytes(tensor), group)
    works, pieces = comm.gather_pieces(tensor, group, async_op)

    def finish():
        return mint.cat([p.chunk(n, split_dim)[me] for p in pieces()], concat_dim).contiguous()
    return handle(works, finish, async_op)


@emulation("reduce_scatter", "emulated: all_reduce, keep own block (2x a ring reduce-scatter)")
def reduce_scatter(comm: Any, tensor: Any, group: Any, dim: Any, op: Any, async_op: Any) -> Any:
    """A full all-reduce, then keep this rank's block (twice the bytes of a ring reduce-scatter,
    and exact for every op)."""
    n, me = len(group), comm.me(group)
    reduced = comm.all_reduce(tensor, group, op, async_op=async_op, tag="reduce_scatter")
    return then(reduced, lambda full: full.chunk(n, dim)[me].contiguous(), async_op)


@emulation("all_reduce", "native for sum/avg/max/min on f16/f32/int8/int32/int64; other dtypes "
                         "emulated: all_gather + local reduction in rank order")
def all_reduce_by_gather(comm: Any, tensor: Any, group: Any, op: Any, async_op: Any, tag: Any) -> Any:
    """Dtypes the kernel refuses (e.g. float64's sum): gather, then reduce in rank order."""
    comm.record(tag or "all_reduce", (len(group) - 1) * nbytes(tensor), group)
    works, pieces = comm.gather_pieces(tensor, group, async_op)
    return handle(works, lambda: _reduce_list(pieces(), op), async_op)


def _reduce_list(pieces, op):
    """Reduce rank-ordered pieces (exact: a fixed order, in the pieces' own dtype)."""
    dtype = pieces[0].dtype
    wide = [p.astype(ms.float64) if dtype == ms.bool_ else p for p in pieces]
    out = wide[0]
    for p in wide[1:]:
        if op in ("sum", "avg"):
            out = out + p
        elif op == "max":
            out = mint.maximum(out, p)
        else:
            out = mint.minimum(out, p)
    if op == "avg":
        out = out / len(pieces)
    if dtype == ms.bool_:
        out = out != 0
    return out.astype(dtype) if out.dtype != dtype else out


@emulation("all_to_all (list)", "emulated: size-table all_gather + one padded all_gather", scope="always")
def all_to_all_list(comm: Any, tensors: Any, group: Any, out_shapes: Any, async_op: Any) -> Any:
    """``tensors[i]`` to group rank i through the size-table exchange."""
    n = len(group)
    received = exchange(comm, [[t] for t in tensors], group, "all_to_all", async_op, recv_counts=[1] * n)
    return then(received, lambda lists: [lists[j][0].reshape(out_shapes[j]) for j in range(n)], async_op)


@emulation("p2p (batch_isend_irecv)", "emulated: size-table all_gather + one padded all_gather "
                                      "over the group (every group rank must call it)")
def p2p_exchange(comm: Any, sends: Any, recvs: Any, group: Any, async_op: Any) -> Any:
    """Point-to-point as a group collective: every rank of ``group`` calls it at the same point."""
    n = len(group)
    per_dst: Any = [[] for _ in range(n)]
    for tensor, dst in sends:
        per_dst[group.ranks.index(dst)].append(tensor)
    counts = [0] * n
    for _, src in recvs:
        counts[group.ranks.index(src)] += 1
    received = exchange(comm, per_dst, group, "send_recv", async_op, recv_counts=counts)

    def finish(lists):
        out, used = [], [0] * n
        for template, src in recvs:
            j = group.ranks.index(src)
            piece = lists[j][used[j]]
            used[j] += 1
            out.append(piece.reshape(tuple(template.shape)).astype(template.dtype))
        return out
    return then(received, finish, async_op)


# =============================================================================== the exchange
def exchange(comm: Any, per_dst: Any, group: Any, tag: Any, async_op: bool = False,
             recv_counts: Any = None) -> Any:
    """Send ``per_dst[j]`` (a list of tensors, one dtype in all) to group rank j; return, per
    source group rank, the list of flat tensors it sent here (in its send order).

    A table of sizes first (every rank gathers who sends how many elements to whom), then every
    rank's payload, padded to the longest, in one all-gather; each rank cuts out what was
    addressed to it. ``recv_counts[j]`` is how many tensors this rank expects from group rank j."""
    n = len(group)
    flat = [[t.reshape(-1) for t in pieces] for pieces in per_dst]
    dtypes = {t.dtype for pieces in flat for t in pieces}
    if len(dtypes) > 1:
        raise ValueError(f"{tag}: the emulated exchange sends one dtype per call, got "
                         f"{sorted(map(str, dtypes))}")
    table = _size_table(comm, flat, group, tag)
    totals = np.where(table < 0, 0, table).sum(axis=(1, 2))        # payload numel per src
    longest = int(totals.max()) if n else 0
    dtype = next(iter(dtypes)) if dtypes else ms.float32
    if longest == 0:
        empty = [[mint.zeros((0,), dtype=dtype) for _ in range(max(0, (recv_counts or [0] * n)[j]))]
                 for j in range(n)]
        return CompletedHandle(empty) if async_op else empty
    mine = [t for pieces in flat for t in pieces]
    payload = mint.cat(mine) if mine else mint.zeros((0,), dtype=dtype)
    if numel(payload) < longest:
        payload = mint.cat([payload, mint.zeros((longest - numel(payload),), dtype=dtype)])
    comm.record(tag, (n - 1) * nbytes(payload), group)
    works, gathered = comm.gather_pieces(payload, group, async_op)
    me = comm.me(group)
    return handle(works, lambda: _cut(gathered(), table, me, group, tag, recv_counts), async_op)


def _size_table(comm, flat, group, tag):
    """[src, dst, i]: the numel of the i-th tensor group rank src sends to dst (-1: none)."""
    n = len(group)
    k = int(_max_int(comm, max(1, max(len(p) for p in flat)), group))
    row = np.full((n, k), -1, dtype=np.int64)
    for j, pieces in enumerate(flat):
        for i, t in enumerate(pieces):
            row[j, i] = numel(t)
    table_pieces = comm.gather_pieces(ms.Tensor(row), group)[1]()
    comm.record(tag, (n - 1) * row.nbytes, group)
    return np.stack([p.asnumpy() for p in table_pieces])


def _cut(buffers, table, me, group, tag, recv_counts):
    """From every source's gathered payload, the tensors it addressed to group rank ``me``."""
    out = []
    for src in range(len(group)):
        sizes = table[src]
        start = int(np.where(sizes[:me] < 0, 0, sizes[:me]).sum())
        pieces = []
        for size in sizes[me]:
            if size < 0:
                break
            pieces.append(buffers[src][start:start + int(size)])
            start += int(size)
        if recv_counts is not None and len(pieces) != recv_counts[src]:
            raise ValueError(f"{tag}: expected {recv_counts[src]} tensor(s) from rank "
                             f"{group.ranks[src]}, it sent {len(pieces)}")
        out.append(pieces)
    return out


def _max_int(comm, value, group):
    """The max of a small int over the group (one tiny all-reduce)."""
    if len(group) == 1:
        return value
    t = ms.Tensor(np.array([value], dtype=np.int32))
    msdist.all_reduce(t, op="max", group=group.name)
    comm.record("all_reduce", 2 * 4 * (len(group) - 1) // len(group), group)
    return int(t.asnumpy()[0])
