"""Raw (non-differentiable) collectives on MindSpore.

The native layer is ``mindspore.mint.distributed`` (the DistComm kernels): unlike the legacy
``ops.AllGather`` / ``ops.AllReduce`` primitives, which on CPU accept only the world group and only
a float sum, they work on sub-groups and do sum/avg/max/min. What MindSpore provides on CPU
(``mccl``, measured with mindspore 2.10):

================  ===========================================  ===================================
collective        CPU                                          emulation here
================  ===========================================  ===================================
all_gather        yes (list form; f16/f32/f64/int8/uint8/      bool and bfloat16 are cast; 0-dim
                  int32/int64; not bool, not empty tensors)    inputs reshaped; empty ones skipped
all_reduce        yes (sum/avg/max/min; f16/f32/int8/int32/    other dtypes (float64, bool, uint8,
                  int64)                                       bfloat16...): all_gather + a local
                                                               reduction in group-rank order
broadcast         yes
all_to_all        no (AlltoAll, all_to_all_single: no kernel)  all_gather, keep own block of each
reduce_scatter    no (ReduceScatter: no kernel)                all_reduce, keep own block
send/recv         no (send, recv, batch_isend_irecv)           size table all_gather + one padded
                                                               all_gather of the flat payloads
================  ===========================================  ===================================

Every emulation is exact (it moves the values, it never approximates them) but sends more bytes
than the native collective would; the bytes reported to ``CommDebugMode`` are the bytes the
emulation really sends (under the logical op's name), so the benchmark shows the difference.

On Ascend/GPU the native all_to_all_single, reduce_scatter_tensor and batch_isend_irecv are used
(``HP_MS_EMULATE_COLLECTIVES=1`` forces the emulations everywhere). Those native branches follow
MindSpore's documented API but have not been run by this project's CI (CPU only).

A "group" here is a :class:`MsGroup`: the MindSpore group name plus the ranks in the order the
group was created with. "Group rank i" is always the i-th rank of that order (a mesh coordinate),
whatever order MindSpore numbers the group in.
"""
import os

import numpy as np

import mindspore as ms
from mindspore import mint, ops
from mindspore.communication import GlobalComm, create_group, get_group_size, get_rank
import mindspore.mint.distributed as msdist

from hyper_parallel.platform.base import AsyncHandle, CompletedHandle

REDUCE_OPS = ("sum", "avg", "max", "min")
# dtypes the DistComm kernels take on CPU (measured; see the module docstring).
_GATHER_DTYPES = {ms.float16, ms.float32, ms.float64, ms.int8, ms.uint8, ms.int32, ms.int64}
_REDUCE_DTYPES = {ms.float16, ms.float32, ms.int8, ms.int32, ms.int64}


def check_reduce_op(op):
    if op not in REDUCE_OPS:
        raise ValueError(f"reduce op {op!r} is not supported; use one of {list(REDUCE_OPS)}")


def nbytes(tensor):
    return int(np.prod(tensor.shape, dtype=np.int64)) * tensor.itemsize


def numel(tensor):
    return int(np.prod(tensor.shape, dtype=np.int64))


class MsGroup:
    """A process group: MindSpore's group name and the ranks in creation order."""

    __slots__ = ("name", "ranks", "_native_order")

    def __init__(self, name, ranks):
        self.name = name
        self.ranks = tuple(ranks)
        ascending = sorted(self.ranks)
        # data that MindSpore returns in ascending-rank order, re-indexed to creation order
        self._native_order = None if list(self.ranks) == ascending else \
            [ascending.index(r) for r in self.ranks]

    def __len__(self):
        return len(self.ranks)

    def __repr__(self):
        return f"MsGroup({self.name!r}, ranks={self.ranks})"

    def to_creation_order(self, pieces):
        return pieces if self._native_order is None else [pieces[i] for i in self._native_order]

    def to_native_order(self, pieces):
        if self._native_order is None:
            return pieces
        out = [None] * len(pieces)
        for mine, native in enumerate(self._native_order):
            out[native] = pieces[mine]
        return out


def _force_emulation():
    return os.environ.get("HP_MS_EMULATE_COLLECTIVES", "").strip().lower() in ("1", "true", "yes", "on")


def _handle(result_or_work, finish, async_op):
    """Either the finished result, or an AsyncHandle whose wait() waits for ``works``."""
    works = result_or_work
    handle = AsyncHandle([w for w in works if w is not None], finish)
    return handle if async_op else handle.wait()


class Collectives:
    """Collectives bound to one platform (for accounting and the backend's capabilities)."""

    def __init__(self, platform):
        self._platform = platform
        self._groups = {}
        self._world = None

    # =========================================================================== groups
    @property
    def native_all(self):
        """True where MindSpore has every collective natively (not CPU), unless forced off."""
        return self._platform.device_type != "cpu" and not _force_emulation()

    def world(self):
        if self._world is None:
            ranks = tuple(range(get_group_size()))
            self._world = MsGroup(GlobalComm.WORLD_COMM_GROUP, ranks)
            self._groups[ranks] = self._world
        return self._world

    def new_group(self, ranks):
        ranks = tuple(int(r) for r in ranks)
        group = self._groups.get(ranks)
        if group is not None:
            return group
        world = self.world()
        if sorted(ranks) == list(world.ranks):
            group = MsGroup(world.name, ranks)
        else:
            ascending = sorted(ranks)
            if len(set(ranks)) != len(ranks) or ascending[0] < 0 or ascending[-1] >= len(world.ranks):
                raise ValueError(f"new_group({list(ranks)}): ranks must be distinct and in "
                                 f"[0, {len(world.ranks)})")
            name = "hp_" + "_".join(map(str, ascending))
            existing = next((g for g in self._groups.values() if g.name == name), None)
            if existing is None and len(ranks) > 1 and get_rank() in ranks:
                create_group(name, ascending)  # members only; MindSpore numbers it ascending
            group = MsGroup(name, ranks)
        self._groups[ranks] = group
        return group

    def resolve(self, group):
        if group is None:
            return self.world()
        if isinstance(group, MsGroup):
            return group
        if isinstance(group, str):
            for g in self._groups.values():
                if g.name == group:
                    return g
            if group == GlobalComm.WORLD_COMM_GROUP:
                return self.world()
        if isinstance(group, (tuple, list)):
            return self.new_group(group)
        raise KeyError(f"unknown process group {group!r}")

    def me(self, group):
        return group.ranks.index(get_rank())

    def clear(self):
        self._groups.clear()
        self._world = None

    def _record(self, op, nbytes_, group):
        if nbytes_:
            self._platform.record_comm(op, int(nbytes_), group.ranks)

    # =========================================================================== native layer
    def _gather_pieces(self, tensor, group, async_op=False):
        """(works, finish) where finish() returns every group rank's ``tensor`` (creation order).

        Handles what the CPU kernels refuse: 0-dim (reshaped), empty (nothing to send: every
        member has the same shape), bool / bfloat16 and other dtypes (cast and cast back)."""
        shape, dtype = tuple(tensor.shape), tensor.dtype
        n = len(group)
        if n == 1:
            return [], lambda: [tensor.copy()]
        if numel(tensor) == 0:
            return [], lambda: [mint.zeros(shape, dtype=dtype) for _ in range(n)]
        wire = tensor.reshape((1,)) if len(shape) == 0 else tensor
        wire_dtype = dtype if dtype in _GATHER_DTYPES else (ms.uint8 if dtype == ms.bool_ else ms.float32)
        wire = wire.astype(wire_dtype) if wire_dtype != dtype else wire
        wire = wire.contiguous()
        outs = [mint.zeros(wire.shape, dtype=wire_dtype) for _ in range(n)]
        work = msdist.all_gather(outs, wire, group=group.name, async_op=async_op)

        def finish():
            pieces = [o.reshape(shape) if len(shape) == 0 else o for o in outs]
            if wire_dtype != dtype:
                pieces = [p.astype(dtype) for p in pieces]
            return group.to_creation_order(pieces)
        return [work] if async_op else [], finish

    # =========================================================================== all-gather
    def all_gather(self, tensor, group, dim=0, async_op=False):
        group = self.resolve(group)
        n = len(group)
        dim = dim % max(tensor.ndim, 1)
        self._record("all_gather", (n - 1) * nbytes(tensor), group)
        works, pieces = self._gather_pieces(tensor, group, async_op)
        if tensor.ndim == 0:  # a 0-dim tensor gathers into a vector
            return _handle(works, lambda: ops.stack(pieces()), async_op)
        return _handle(works, lambda: mint.cat(pieces(), dim).contiguous(), async_op)

    # =========================================================================== all-reduce
    def all_reduce(self, tensor, group, op="sum", async_op=False, tag=None):
        check_reduce_op(op)
        group = self.resolve(group)
        n = len(group)
        if n == 1 or numel(tensor) == 0:
            return _done(tensor.copy(), async_op)
        dtype = tensor.dtype
        if dtype in _REDUCE_DTYPES or dtype == ms.bfloat16:
            wire = tensor.astype(ms.float32) if dtype == ms.bfloat16 else tensor
            out = wire.contiguous().copy() if wire is tensor else wire.contiguous()
            shape = tuple(tensor.shape)
            if not shape:
                out = out.reshape((1,))
            self._record(tag or "all_reduce", 2 * nbytes(tensor) * (n - 1) // n, group)
            work = msdist.all_reduce(out, op=op, group=group.name, async_op=async_op)

            def finish():
                result = out.reshape(shape) if not shape else out
                return result.astype(dtype) if dtype == ms.bfloat16 else result
            return _handle([work] if async_op else [], finish, async_op)
        # e.g. float64 (whose sum the CPU kernel refuses): gather, then reduce in rank order
        self._record(tag or "all_reduce", (n - 1) * nbytes(tensor), group)
        works, pieces = self._gather_pieces(tensor, group, async_op)
        return _handle(works, lambda: _reduce_list(pieces(), op), async_op)

    # =========================================================================== broadcast
    def broadcast(self, tensor, src, group, async_op=False):
        group = self.resolve(group)
        if src not in group.ranks:
            raise ValueError(f"broadcast: source rank {src} is not in the group {group.ranks}")
        n = len(group)
        out = tensor.contiguous().copy() if tensor.dtype != ms.bool_ else tensor.astype(ms.int32)
        if n == 1 or numel(tensor) == 0:
            return _done(out.astype(tensor.dtype) if tensor.dtype == ms.bool_ else out, async_op)
        if get_rank() == src:
            self._record("broadcast", nbytes(tensor), group)
        wire = out.reshape((1,)) if tensor.ndim == 0 else out
        work = msdist.broadcast(wire, src=int(src), group=group.name, async_op=async_op)

        def finish():
            result = wire.reshape(()) if tensor.ndim == 0 else wire
            return result.astype(tensor.dtype) if tensor.dtype == ms.bool_ else result
        return _handle([work] if async_op else [], finish, async_op)

    # =========================================================================== all-to-all
    def all_to_all_single(self, tensor, group, split_dim=0, concat_dim=0, async_op=False):
        group = self.resolve(group)
        n = len(group)
        ndim = tensor.ndim
        split_dim, concat_dim = split_dim % ndim, concat_dim % ndim
        size = tensor.shape[split_dim]
        if size % n:
            raise ValueError(f"all_to_all_single: dim {split_dim} has size {size}, not divisible by "
                             f"the group size {n}; pad it or use an uneven redistribution")
        if n == 1:
            return _done(tensor.contiguous().copy(), async_op)
        if self.native_all:
            return self._native_all_to_all_single(tensor, group, split_dim, concat_dim, async_op)
        # Emulated: everyone gathers every rank's whole tensor and keeps its own block of each.
        me = self.me(group)
        self._record("all_to_all", (n - 1) * nbytes(tensor), group)
        works, pieces = self._gather_pieces(tensor, group, async_op)

        def finish():
            return mint.cat([p.chunk(n, split_dim)[me] for p in pieces()], concat_dim).contiguous()
        return _handle(works, finish, async_op)

    def _native_all_to_all_single(self, tensor, group, split_dim, concat_dim, async_op):
        n = len(group)
        size = tensor.shape[split_dim]
        blocks = list(tensor.chunk(n, split_dim))
        blocks = group.to_native_order(blocks)   # MindSpore's block j goes to its group rank j
        send = mint.cat([b.contiguous().reshape(-1) for b in blocks])
        recv = mint.zeros(send.shape, dtype=send.dtype)
        self._record("all_to_all", nbytes(send) * (n - 1) // n, group)
        work = msdist.all_to_all_single(recv, send, group=group.name, async_op=async_op)
        block_shape = list(tensor.shape)
        block_shape[split_dim] = size // n

        def finish():
            pieces = group.to_creation_order([p.reshape(block_shape) for p in recv.chunk(n, 0)])
            return mint.cat(pieces, concat_dim).contiguous()
        return _handle([work] if async_op else [], finish, async_op)

    def all_to_all(self, tensors, group, out_shapes=None, async_op=False):
        """List form: ``tensors[i]`` goes to group rank i; the piece from group rank j comes back
        shaped ``out_shapes[j]`` (default ``tensors[j].shape``). Emulated on every backend by the
        size-table exchange (:meth:`exchange`)."""
        group = self.resolve(group)
        n = len(group)
        if len(tensors) != n:
            raise ValueError(f"all_to_all needs one tensor per rank ({n}), got {len(tensors)}")
        out_shapes = [tuple(s) for s in (out_shapes or [t.shape for t in tensors])]
        received = self.exchange([[t] for t in tensors], group, "all_to_all", async_op,
                                 recv_counts=[1] * n)

        def finish(lists):
            return [lists[j][0].reshape(out_shapes[j]) for j in range(n)]
        if async_op:
            return AsyncHandle([received], lambda: finish(received.wait()))
        return finish(received)

    # =========================================================================== reduce-scatter
    def reduce_scatter(self, tensor, group, dim=0, op="sum", async_op=False):
        check_reduce_op(op)
        group = self.resolve(group)
        n = len(group)
        dim = dim % tensor.ndim
        size = tensor.shape[dim]
        if size % n:
            raise ValueError(f"reduce_scatter: dim {dim} has size {size}, not divisible by the group "
                             f"size {n}; pad it or use an uneven redistribution")
        if n == 1:
            return _done(tensor.contiguous().copy(), async_op)
        me = self.me(group)
        if self.native_all and tensor.dtype in _REDUCE_DTYPES:
            blocks = group.to_native_order(list(tensor.chunk(n, dim)))
            send = mint.cat([b.contiguous().reshape(-1) for b in blocks])
            out = mint.zeros((numel(send) // n,), dtype=send.dtype)
            self._record("reduce_scatter", nbytes(send) * (n - 1) // n, group)
            work = msdist.reduce_scatter_tensor(out, send, op=op, group=group.name, async_op=async_op)
            block_shape = list(tensor.shape)
            block_shape[dim] = size // n
            return _handle([work] if async_op else [], lambda: out.reshape(block_shape), async_op)
        # Emulated: a full all-reduce, then keep this rank's block (twice the bytes of a ring
        # reduce-scatter, and exact for every op).
        reduced = self.all_reduce(tensor, group, op, async_op=async_op, tag="reduce_scatter")

        def finish(full):
            return full.chunk(n, dim)[me].contiguous()
        if async_op:
            return AsyncHandle([reduced], lambda: finish(reduced.wait()))
        return finish(reduced)

    # =========================================================================== point-to-point
    def p2p_exchange(self, sends, recvs, group=None, async_op=False):
        """``sends`` = [(tensor, global_dst)], ``recvs`` = [(template, global_src)]: returns the
        received tensors (shaped and typed like their templates), in ``recvs`` order.

        Emulated on CPU, where every rank of ``group`` (default: the world) must call it at the
        same point, also ranks with nothing to send or receive."""
        group = self.resolve(group)
        for _, peer in list(sends) + list(recvs):
            if peer not in group.ranks:
                raise ValueError(f"p2p_exchange: peer {peer} is not in the group {group.ranks}")
        if self.native_all:
            return self._native_p2p(sends, recvs, group, async_op)
        n = len(group)
        per_dst = [[] for _ in range(n)]
        for tensor, dst in sends:
            per_dst[group.ranks.index(dst)].append(tensor)
        counts = [0] * n
        for _, src in recvs:
            counts[group.ranks.index(src)] += 1
        received = self.exchange(per_dst, group, "send_recv", async_op, recv_counts=counts)

        def finish(lists):
            out, used = [], [0] * n
            for template, src in recvs:
                j = group.ranks.index(src)
                piece = lists[j][used[j]]
                used[j] += 1
                out.append(piece.reshape(tuple(template.shape)).astype(template.dtype))
            return out
        if async_op:
            return AsyncHandle([received], lambda: finish(received.wait()))
        return finish(received)

    def _native_p2p(self, sends, recvs, group, async_op):
        ops_, outputs = [], []
        for tensor, peer in sends:
            ops_.append(msdist.P2POp("isend", tensor.contiguous(), int(peer), group=group.name))
        for template, peer in recvs:
            buf = mint.zeros(tuple(template.shape), dtype=template.dtype)
            outputs.append(buf)
            ops_.append(msdist.P2POp("irecv", buf, int(peer), group=group.name))
        sent = sum(nbytes(t) for t, _ in sends)
        self._record("send_recv", sent, group)
        works = msdist.batch_isend_irecv(ops_) if ops_ else []
        return _handle(list(works), lambda: outputs, async_op)

    # =========================================================================== the exchange
    def exchange(self, per_dst, group, tag, async_op=False, recv_counts=None):
        """Send ``per_dst[j]`` (a list of tensors, one dtype in all) to group rank j; return, per
        source group rank, the list of flat tensors it sent here (in its send order).

        Emulation of all-to-all / send-recv with all-gather: a table of sizes first (every rank
        gathers who sends how many elements to whom), then every rank's payload, padded to the
        longest, in one all-gather; each rank cuts out what was addressed to it. ``recv_counts[j]``
        is how many tensors this rank expects from group rank j (split points come from the
        table: each tensor's numel is listed)."""
        n = len(group)
        me = self.me(group)
        flat = [[t.reshape(-1) for t in pieces] for pieces in per_dst]
        dtypes = {t.dtype for pieces in flat for t in pieces}
        if len(dtypes) > 1:
            raise ValueError(f"{tag}: the emulated exchange sends one dtype per call, got "
                             f"{sorted(map(str, dtypes))}")
        k = max(1, max(len(p) for p in flat))
        # table row of this rank: for each destination, the numel of each of its (<= k) tensors
        k = int(self._max_int(k, group))
        row = np.full((n, k), -1, dtype=np.int64)
        for j, pieces in enumerate(flat):
            for i, t in enumerate(pieces):
                row[j, i] = numel(t)
        table_pieces = self._gather_pieces(ms.Tensor(row), group)[1]()
        table = np.stack([p.asnumpy() for p in table_pieces])          # [src, dst, i]
        self._record(tag, (n - 1) * row.nbytes, group)
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
        self._record(tag, (n - 1) * nbytes(payload), group)
        works, gathered = self._gather_pieces(payload, group, async_op)

        def finish():
            buffers = gathered()
            out = []
            for src in range(n):
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
        return _handle(works, finish, async_op)

    def _max_int(self, value, group):
        """The max of a small int over the group (one tiny all-reduce)."""
        if len(group) == 1:
            return value
        t = ms.Tensor(np.array([value], dtype=np.int32))
        msdist.all_reduce(t, op="max", group=group.name)
        self._record("all_reduce", 2 * 4 * (len(group) - 1) // len(group), group)
        return int(t.asnumpy()[0])


def _done(result, async_op):
    return CompletedHandle(result) if async_op else result


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
