"""Raw (non-differentiable) collectives on MindSpore: the native paths.

The native layer is ``mindspore.mint.distributed`` (the DistComm kernels): unlike the legacy
``ops.AllGather`` / ``ops.AllReduce`` primitives, which on CPU accept only the world group and only
a float sum, they work on sub-groups and do sum/avg/max/min. What MindSpore provides on CPU
(``mccl``, measured with mindspore 2.10): all_gather (list form; f16/f32/f64/int8/uint8/int32/int64;
not bool, not empty tensors), all_reduce (sum/avg/max/min on f16/f32/int8/int32/int64) and
broadcast; no all_to_all, reduce_scatter or send/recv kernels. What is missing is emulated in
``emulations.py``, which also holds the descriptions ``capabilities()`` shows.

On Ascend/GPU the native all_to_all_single, reduce_scatter_tensor and batch_isend_irecv are used
(``HP_MS_EMULATE_COLLECTIVES=1`` forces the emulations everywhere). Those native branches follow
MindSpore's documented API but have not been run by this project's CI (CPU only).
"""
from typing import Any
import mindspore as ms
from mindspore import mint, ops
from mindspore.communication import GlobalComm, create_group, get_group_size, get_rank
import mindspore.mint.distributed as msdist

from hyper_parallel.platform.mindspore import emulations, placeholder_guard
from hyper_parallel.platform.mindspore.groups import (MsGroup, check_reduce_op, done, force_emulation,
                                                      handle, nbytes, numel)

# dtypes the DistComm kernels take on CPU (measured; see the module docstring).
_GATHER_DTYPES = {ms.float16, ms.float32, ms.float64, ms.int8, ms.uint8, ms.int32, ms.int64}
_REDUCE_DTYPES = {ms.float16, ms.float32, ms.int8, ms.int32, ms.int64}
# capabilities() where every collective has its kernel; emulations.py overrides the missing ones
NATIVE = {"all_gather": "native", "all_reduce": "native", "broadcast": "native",
          "all_to_all_single": "native", "reduce_scatter": "native",
          "p2p (batch_isend_irecv)": "native (not run in CI)", "all_reduce avg/max/min": "native"}
emulations.register("all_gather", "native (mint.distributed; bool/bfloat16 cast, 0-dim reshaped)")


class Collectives:
    """Collectives bound to one platform (for accounting and the backend's capabilities)."""

    def __init__(self, platform: Any) -> None:
        self._platform = platform
        self._groups: dict[Any, Any] = {}
        self._world: Any = None

    # =========================================================================== groups
    @property
    def native_all(self) -> bool:
        """True where MindSpore has every collective natively (not CPU), unless forced off."""
        return self._platform.device_type != "cpu" and not force_emulation()

    def capabilities(self) -> Any:
        return emulations.capability_table(NATIVE, emulating=not self.native_all)

    def world(self) -> Any:
        if self._world is None:
            ranks = tuple(range(get_group_size()))
            self._world = MsGroup(GlobalComm.WORLD_COMM_GROUP, ranks)
            self._groups[ranks] = self._world
        return self._world

    def new_group(self, ranks: Any) -> Any:
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

    def resolve(self, group: Any) -> Any:
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

    def me(self, group: Any) -> Any:
        return group.ranks.index(get_rank())

    def clear(self) -> None:
        self._groups.clear()
        self._world = None

    def record(self, op: Any, nbytes_: Any, group: Any) -> None:
        # every collective passes here first: inside ms.jit(capture_mode="trace") it would be recorded
        # into the graph (a rank check's all-reduce on a constant made the trace unclosable, and every
        # later trace of the process failed), so it refuses as a DTensor operator does
        if placeholder_guard.tracing():
            placeholder_guard.check_not_tracing(None, what=f"hyper_parallel's {op}")
        if nbytes_:
            self._platform.record_comm(op, int(nbytes_), group.ranks)

    # =========================================================================== native layer
    def gather_pieces(self, tensor: Any, group: Any, async_op: bool = False) -> Any:
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

    def all_gather(self, tensor: Any, group: Any, dim: int = 0, async_op: bool = False) -> Any:
        group = self.resolve(group)
        dim = dim % max(tensor.ndim, 1)
        self.record("all_gather", (len(group) - 1) * nbytes(tensor), group)
        works, pieces = self.gather_pieces(tensor, group, async_op)
        if tensor.ndim == 0:  # a 0-dim tensor gathers into a vector
            return handle(works, lambda: ops.stack(pieces()), async_op)
        return handle(works, lambda: mint.cat(pieces(), dim).contiguous(), async_op)

    def all_reduce(self, tensor: Any, group: Any, op: str = "sum", async_op: bool = False,
                   tag: Any = None) -> Any:
        check_reduce_op(op)
        group = self.resolve(group)
        n = len(group)
        if n == 1 or numel(tensor) == 0:
            return done(tensor.copy(), async_op)
        dtype = tensor.dtype
        if dtype not in _REDUCE_DTYPES and dtype != ms.bfloat16:
            return emulations.all_reduce_by_gather(self, tensor, group, op, async_op, tag)
        wire = tensor.astype(ms.float32) if dtype == ms.bfloat16 else tensor
        out = wire.contiguous().copy() if wire is tensor else wire.contiguous()
        shape = tuple(tensor.shape)
        if not shape:
            out = out.reshape((1,))
        self.record(tag or "all_reduce", 2 * nbytes(tensor) * (n - 1) // n, group)
        work = msdist.all_reduce(out, op=op, group=group.name, async_op=async_op)

        def finish():
            result = out.reshape(shape) if not shape else out
            return result.astype(dtype) if dtype == ms.bfloat16 else result
        return handle([work] if async_op else [], finish, async_op)

    def broadcast(self, tensor: Any, src: Any, group: Any, async_op: bool = False) -> Any:
        group = self.resolve(group)
        if src not in group.ranks:
            raise ValueError(f"broadcast: source rank {src} is not in the group {group.ranks}")
        out = tensor.contiguous().copy() if tensor.dtype != ms.bool_ else tensor.astype(ms.int32)
        if len(group) == 1 or numel(tensor) == 0:
            return done(out.astype(tensor.dtype) if tensor.dtype == ms.bool_ else out, async_op)
        if get_rank() == src:
            self.record("broadcast", nbytes(tensor), group)
        wire = out.reshape((1,)) if tensor.ndim == 0 else out
        work = msdist.broadcast(wire, src=int(src), group=group.name, async_op=async_op)

        def finish():
            result = wire.reshape(()) if tensor.ndim == 0 else wire
            return result.astype(tensor.dtype) if tensor.dtype == ms.bool_ else result
        return handle([work] if async_op else [], finish, async_op)

    # =========================================================================== all-to-all
    def all_to_all_single(self, tensor: Any, group: Any, split_dim: int = 0, concat_dim: int = 0,
                          async_op: bool = False) -> Any:
        group = self.resolve(group)
        n = len(group)
        split_dim, concat_dim = split_dim % tensor.ndim, concat_dim % tensor.ndim
        size = tensor.shape[split_dim]
        if size % n:
            raise ValueError(f"all_to_all_single: dim {split_dim} has size {size}, not divisible by "
                             f"the group size {n}; pad it or use an uneven redistribution")
        if n == 1:
            return done(tensor.contiguous().copy(), async_op)
        if not self.native_all:
            return emulations.all_to_all_single(self, tensor, group, split_dim, concat_dim, async_op)
        blocks = group.to_native_order(list(tensor.chunk(n, split_dim)))  # block j to its rank j
        send = mint.cat([b.contiguous().reshape(-1) for b in blocks])
        recv = mint.zeros(send.shape, dtype=send.dtype)
        self.record("all_to_all", nbytes(send) * (n - 1) // n, group)
        work = msdist.all_to_all_single(recv, send, group=group.name, async_op=async_op)
        block_shape = list(tensor.shape)
        block_shape[split_dim] = size // n

        def finish():
            pieces = group.to_creation_order([p.reshape(block_shape) for p in recv.chunk(n, 0)])
            return mint.cat(pieces, concat_dim).contiguous()
        return handle([work] if async_op else [], finish, async_op)

    def all_to_all(self, tensors: Any, group: Any, out_shapes: Any = None, async_op: bool = False) -> Any:
        """List form: ``tensors[i]`` goes to group rank i; the piece from group rank j comes back
        shaped ``out_shapes[j]`` (default ``tensors[j].shape``). Emulated on every backend."""
        group = self.resolve(group)
        if len(tensors) != len(group):
            raise ValueError(f"all_to_all needs one tensor per rank ({len(group)}), got {len(tensors)}")
        out_shapes = [tuple(s) for s in (out_shapes or [t.shape for t in tensors])]
        return emulations.all_to_all_list(self, tensors, group, out_shapes, async_op)

    # =========================================================================== reduce-scatter
    def reduce_scatter(self, tensor: Any, group: Any, dim: int = 0, op: str = "sum",
                       async_op: bool = False) -> Any:
        check_reduce_op(op)
        group = self.resolve(group)
        n = len(group)
        dim = dim % tensor.ndim
        size = tensor.shape[dim]
        if size % n:
            raise ValueError(f"reduce_scatter: dim {dim} has size {size}, not divisible by the group "
                             f"size {n}; pad it or use an uneven redistribution")
        if n == 1:
            return done(tensor.contiguous().copy(), async_op)
        if not (self.native_all and tensor.dtype in _REDUCE_DTYPES):
            return emulations.reduce_scatter(self, tensor, group, dim, op, async_op)
        blocks = group.to_native_order(list(tensor.chunk(n, dim)))
        send = mint.cat([b.contiguous().reshape(-1) for b in blocks])
        out = mint.zeros((numel(send) // n,), dtype=send.dtype)
        self.record("reduce_scatter", nbytes(send) * (n - 1) // n, group)
        work = msdist.reduce_scatter_tensor(out, send, op=op, group=group.name, async_op=async_op)
        block_shape = list(tensor.shape)
        block_shape[dim] = size // n
        return handle([work] if async_op else [], lambda: out.reshape(block_shape), async_op)

    # =========================================================================== point-to-point
    def p2p_exchange(self, sends: Any, recvs: Any, group: Any = None, async_op: bool = False) -> Any:
        """``sends`` = [(tensor, global_dst)], ``recvs`` = [(template, global_src)]: returns the
        received tensors (shaped and typed like their templates), in ``recvs`` order. Emulated on
        CPU, where every rank of ``group`` (default: the world) must call it at the same point."""
        group = self.resolve(group)
        for _, peer in list(sends) + list(recvs):
            if peer not in group.ranks:
                raise ValueError(f"p2p_exchange: peer {peer} is not in the group {group.ranks}")
        if not self.native_all:
            return emulations.p2p_exchange(self, sends, recvs, group, async_op)
        ops_, outputs = [], []
        for tensor, peer in sends:
            ops_.append(msdist.P2POp("isend", tensor.contiguous(), int(peer), group=group.name))
        for template, peer in recvs:
            buf = mint.zeros(tuple(template.shape), dtype=template.dtype)
            outputs.append(buf)
            ops_.append(msdist.P2POp("irecv", buf, int(peer), group=group.name))
        self.record("send_recv", sum(nbytes(t) for t, _ in sends), group)
        works = msdist.batch_isend_irecv(ops_) if ops_ else []
        return handle(list(works), lambda: outputs, async_op)
