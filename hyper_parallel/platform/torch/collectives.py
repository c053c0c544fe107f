"""Raw (non-differentiable) collectives on torch.distributed.

Every function takes tensors of any layout and returns new contiguous tensors. Where the backend
lacks a collective, or implements it weakly, it is emulated with one that exists; the capability
table in ``platform.py`` says which.
"""
from typing import Any
import torch
import torch.distributed as dist

from hyper_parallel.platform.handles import AsyncHandle, CompletedHandle
from hyper_parallel.platform.torch import compile_collectives as traced
from hyper_parallel.platform.torch.dtype_widening import widening

# torch renamed all_gather_into_tensor to all_gather_single; accept both (torch>=2.4).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
               "avg": dist.ReduceOp.SUM}


def check_reduce_op(op: Any) -> None:
    if op not in _REDUCE_OPS:
        raise ValueError(f"reduce op {op!r} is not supported; use one of {sorted(_REDUCE_OPS)}")


def _nbytes(tensor):
    return tensor.numel() * tensor.element_size()


class CollectiveError(RuntimeError):
    """A collective failed in the backend (a peer closed its connection, ...); the message names
    the collective, the group's ranks and its timeout."""


class CollectiveTimeoutError(TimeoutError, CollectiveError):
    """A collective did not complete within its group's timeout: some rank of the group never
    joined it (it raised, exited, or took another code path)."""


def collective_error(op: Any, ranks: Any, timeout_s: Any, exc: Any) -> Any:
    """The error to raise for backend error ``exc`` in collective ``op`` on group ``ranks``."""
    limit = "the default timeout" if timeout_s is None else f"{timeout_s:g} s"
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if "timed out" in text.lower() or "timeout" in text.lower():
        return CollectiveTimeoutError(
            f"{op} on process group ranks {list(ranks)} timed out after {limit}: a rank of the group did not "
            f"join it (did one raise, exit or skip the collective?). Backend: {text}")
    return CollectiveError(f"{op} on process group ranks {list(ranks)} failed (collective timeout {limit}); "
                           f"a peer has probably failed or exited. Backend: {text}")


class _NamedWork:
    """A backend work handle whose wait() raises the named error."""

    def __init__(self, work, describe):
        self._work, self._describe = work, describe

    def wait(self):
        try:
            return self._work.wait()
        except RuntimeError as exc:
            if isinstance(exc, CollectiveError):
                raise
            raise self._describe(exc) from exc


class Collectives:
    """Collectives bound to one platform (for accounting and backend quirks)."""

    def __init__(self, platform: Any) -> None:
        self._platform = platform

    def _backend_is(self, group, name):
        return dist.get_backend(group) == name

    def _finish(self, async_op, works, finish):
        handle = AsyncHandle([w for w in works if w is not None], finish)
        return handle if async_op else handle.wait()

    def _launch(self, op, group, start, async_op=False):
        """Run ``start()`` (a torch.distributed call); backend errors, now or at wait(), become a
        CollectiveError naming ``op``, the group's ranks and its timeout. Returns the works to
        wait for (none when synchronous)."""
        def describe(exc):
            return collective_error(op, self._platform.group_ranks(group),
                                    self._platform.group_timeout(group), exc)
        try:
            work = start()
        except RuntimeError as exc:
            raise describe(exc) from exc
        works = work if isinstance(work, list) else [work]
        return [_NamedWork(w, describe) for w in works if w is not None] if async_op else []

    def _record(self, op, nbytes, group):
        self._platform.record_comm(op, nbytes, self._platform.group_ranks(group))

    def _order(self, group):
        """Block order of a group created with ranks not in ascending order (e.g. a mesh line
        [3, 2, 1, 0]): torch numbers a group's ranks ascending, but "group rank i" here is the
        i-th rank the group was created with (its mesh coordinate). Returns (order, inverse): data
        in torch order is ``x[order]`` in creation order, creation order ``y[inverse]`` in torch
        order; None when the two orders agree."""
        ranks = list(self._platform.group_ranks(group))
        ascending = sorted(ranks)
        if ranks == ascending:
            return None
        order = [ascending.index(r) for r in ranks]
        return order, [ranks.index(r) for r in ascending]

    # --------------------------------------------------------------------------- all-gather
    @widening
    def all_gather(self, tensor: Any, group: Any, dim: int = 0, async_op: bool = False) -> Any:
        if tensor.dim() == 0:  # a 0-dim tensor gathers into a vector (as on every platform)
            tensor = tensor.reshape(1)
        n = dist.get_world_size(group)
        if n == 1:
            return self._trivial(tensor.clone(memory_format=torch.contiguous_format), async_op)
        if traced.tracing(tensor):
            return traced.all_gather(self, tensor, group, dim, async_op)
        moved = tensor.movedim(dim, 0).contiguous()
        out = torch.empty((n * moved.shape[0],) + tuple(moved.shape[1:]), dtype=tensor.dtype,
                          device=tensor.device)
        self._record("all_gather", (n - 1) * _nbytes(moved), group)
        if self._backend_is(group, "gloo"):
            # gloo's all-gather moves a byte 2-3x slower than its all-to-all (measured at 2 and 4
            # ranks, 1 KiB to 8 MiB): n copies of the piece through one all-to-all deliver the
            # same bytes into the same [rank, piece] layout
            copies = moved.unsqueeze(0).expand((n,) + tuple(moved.shape)).contiguous().view(out.shape)
            works = self._launch("all_gather", group, lambda: dist.all_to_all_single(
                out, copies, group=group, async_op=async_op), async_op)
        else:
            works = self._launch("all_gather", group,
                                 lambda: _all_gather_single(out, moved, group=group, async_op=async_op),
                                 async_op)
        perm = self._order(group)

        def finish():
            result = out
            if perm is not None:
                result = out.unflatten(0, (n, moved.shape[0]))[perm[0]].flatten(0, 1)
            return result.movedim(0, dim).contiguous()
        return self._finish(async_op, works, finish)

    def _blocks(self, tensor, dim, n, group, op):
        """``tensor`` split along ``dim`` into n equal blocks stacked on a leading dim, in the
        order torch numbers the group's ranks; and that order's permutation (or None)."""
        size = tensor.shape[dim]
        if size % n:
            raise ValueError(f"{op}: dim {dim} has size {size}, not divisible by the group size {n}; "
                             f"pad it or use an uneven redistribution")
        if n == 1:
            return None, None
        blocks = tensor.unflatten(dim, (n, size // n)).movedim(dim, 0).contiguous()
        perm = self._order(group)
        return (blocks if perm is None else blocks[perm[1]]), perm

    # --------------------------------------------------------------------------- all-to-all
    @widening
    def all_to_all_single(self, tensor: Any, group: Any, split_dim: int = 0, concat_dim: int = 0,
                          async_op: bool = False) -> Any:
        n = dist.get_world_size(group)
        split_dim, concat_dim = split_dim % tensor.dim(), concat_dim % tensor.dim()  # negative dims
        if n == 1:
            self._blocks(tensor, split_dim, n, group, "all_to_all_single")  # same checks
            return self._trivial(tensor.clone(memory_format=torch.contiguous_format), async_op)
        blocks, perm = self._blocks(tensor, split_dim, n, group, "all_to_all_single")
        if traced.tracing(tensor):
            return traced.all_to_all_single(self, blocks, perm, group, concat_dim, async_op)
        out = torch.empty_like(blocks)
        self._record("all_to_all", _nbytes(blocks) * (n - 1) // n, group)
        works = self._launch("all_to_all_single", group,
                             lambda: dist.all_to_all_single(out, blocks, group=group, async_op=async_op),
                             async_op)

        def finish():
            received = out if perm is None else out[perm[0]]
            return received.movedim(0, concat_dim).flatten(concat_dim, concat_dim + 1).contiguous()
        return self._finish(async_op, works, finish)

    @widening
    def all_to_all(self, tensors: Any, group: Any, out_shapes: Any = None, async_op: bool = False) -> Any:
        """List all-to-all, emulated with one uneven all_to_all_single of flattened buffers
        (gloo has no list form)."""
        n = dist.get_world_size(group)
        if len(tensors) != n:
            raise ValueError(f"all_to_all needs one tensor per rank ({n}), got {len(tensors)}")
        out_shapes = out_shapes or [t.shape for t in tensors]
        perm = self._order(group)
        if perm is not None:
            tensors = [tensors[i] for i in perm[1]]
            out_shapes = [out_shapes[i] for i in perm[1]]
        dtype, device = tensors[0].dtype, tensors[0].device
        if traced.tracing(tensors[0]):
            traced.unsupported("all_to_all (list form)")
        send = torch.cat([t.reshape(-1) for t in tensors]) if n > 1 else tensors[0].reshape(-1).clone()
        in_splits = [t.numel() for t in tensors]
        out_splits = [int(torch.Size(s).numel()) for s in out_shapes]
        recv = torch.empty(sum(out_splits), dtype=dtype, device=device)
        me = dist.get_rank(group)
        self._record("all_to_all", (send.numel() - in_splits[me]) * send.element_size(), group)
        works = self._launch("all_to_all", group, lambda: dist.all_to_all_single(
            recv, send, out_splits, in_splits, group=group, async_op=async_op), async_op)

        def finish():
            pieces = [piece.reshape(shape) for piece, shape in
                      zip(torch.split(recv, out_splits), out_shapes)]
            return pieces if perm is None else [pieces[i] for i in perm[0]]
        return self._finish(async_op, works, finish)

    # --------------------------------------------------------------------------- reductions
    @widening
    def reduce_scatter(self, tensor: Any, group: Any, dim: int = 0, op: str = "sum",
                       async_op: bool = False) -> Any:
        check_reduce_op(op)
        n = dist.get_world_size(group)
        dim = dim % tensor.dim()  # unflatten + movedim below need a non-negative dim
        if n == 1:
            self._blocks(tensor, dim, n, group, "reduce_scatter")  # same checks
            return self._trivial(tensor.clone(memory_format=torch.contiguous_format), async_op)
        blocks, perm = self._blocks(tensor, dim, n, group, "reduce_scatter")
        if traced.tracing(tensor):
            return traced.reduce_scatter(self, blocks, perm, group, op, _reduce_stack, async_op)
        self._record("reduce_scatter", _nbytes(blocks) * (n - 1) // n, group)
        if self._backend_is(group, "gloo"):
            # gloo's reduce-scatter is weak (op and dtype gaps): one all-to-all moves exactly the
            # bytes of a ring reduce-scatter, and the reduction happens locally in rank order.
            received = torch.empty_like(blocks)
            works = self._launch("reduce_scatter", group, lambda: dist.all_to_all_single(
                received, blocks, group=group, async_op=async_op), async_op)
            return self._finish(async_op, works,
                                lambda: _reduce_stack(received if perm is None else received[perm[0]],
                                                      op, n))
        out = torch.empty(blocks.shape[1:], dtype=tensor.dtype, device=tensor.device)
        native_op = dist.ReduceOp.AVG if op == "avg" and not self._backend_is(group, "gloo") \
            else _REDUCE_OPS[op]
        works = self._launch("reduce_scatter", group, lambda: dist.reduce_scatter_tensor(
            out, blocks, op=native_op, group=group, async_op=async_op), async_op)
        return self._finish(async_op, works,
                            lambda: out / n if op == "avg" and native_op != dist.ReduceOp.AVG else out)

    @widening
    def all_reduce(self, tensor: Any, group: Any, op: str = "sum", async_op: bool = False,
                   tag: Any = None) -> Any:
        check_reduce_op(op)
        n = dist.get_world_size(group)
        out = tensor.contiguous().clone()
        if n == 1:
            return self._trivial(out, async_op)
        if traced.tracing(tensor):
            return traced.all_reduce(self, out, group, op, async_op, tag)
        if op in ("max", "min") and out.is_floating_point():
            return self._nan_propagating_extreme(out, group, op, async_op, tag)
        return self._all_reduce(out, group, op, n, async_op, tag)

    def _nan_propagating_extreme(self, out, group, op, async_op, tag):
        """Backends' max/min drop a NaN where torch.maximum / torch.minimum return it. A NaN flag
        rides in the same all-reduce (+1 under max, -1 under min, so the op itself merges flags)."""
        flag = torch.isnan(out).to(out.dtype)
        packed = torch.stack([out, flag if op == "max" else -flag])
        n = dist.get_world_size(group)

        def unpack(reduced):
            return torch.where(reduced[1] != 0, torch.full_like(reduced[0], float("nan")), reduced[0])
        result = self._all_reduce(packed, group, op, n, async_op, tag)
        if async_op:
            return AsyncHandle([result], lambda: unpack(packed))
        return unpack(result)

    def _all_reduce(self, out, group, op, n, async_op, tag):
        self._record(tag or "all_reduce", 2 * _nbytes(out) * (n - 1) // n, group)
        native_avg = op == "avg" and dist.get_backend(group) == "nccl"
        native = dist.ReduceOp.AVG if native_avg else _REDUCE_OPS[op]
        works = self._launch(tag or "all_reduce", group,
                             lambda: dist.all_reduce(out, op=native, group=group, async_op=async_op),
                             async_op)
        scale = op == "avg" and not native_avg
        return self._finish(async_op, works,
                            lambda: out.div_(n) if scale else out)

    @widening
    def broadcast(self, tensor: Any, src: Any, group: Any, async_op: bool = False) -> Any:
        n = dist.get_world_size(group)
        out = tensor.contiguous().clone()
        if n == 1:
            return self._trivial(out, async_op)
        if traced.tracing(tensor):
            return traced.broadcast(self, out, src, group, async_op)
        if dist.get_rank() == src:
            self._record("broadcast", _nbytes(out), group)
        works = self._launch("broadcast", group,
                             lambda: dist.broadcast(out, src=src, group=group, async_op=async_op), async_op)
        return self._finish(async_op, works, lambda: out)

    # --------------------------------------------------------------------------- point-to-point
    def p2p_exchange(self, sends: Any, recvs: Any, group: Any = None, async_op: bool = False) -> Any:
        me = dist.get_rank()
        if any(traced.tracing(t) for t, _ in list(sends) + list(recvs)):
            # traced only where every rank of the group makes the same calls (compile_collectives)
            if not (async_op and sends and recvs):
                traced.unsupported("p2p_exchange")
            return traced.p2p_exchange(self, sends, recvs, group, async_op)
        # a message to oneself (a ring of one rank) is a copy: gloo has no pair to itself
        to_self = [tensor for tensor, peer in sends if peer == me]
        ops, outputs = [], []
        for tensor, peer in sends:
            if peer != me:
                ops.append(dist.P2POp(dist.isend, tensor.contiguous(), peer, group=group))
        for template, peer in recvs:
            if peer == me:
                outputs.append(to_self.pop(0).clone(memory_format=torch.contiguous_format))
                continue
            buf = torch.empty(template.shape, dtype=template.dtype, device=template.device)
            outputs.append(buf)
            ops.append(dist.P2POp(dist.irecv, buf, peer, group=group))
        sent = sum(_nbytes(t) for t, peer in sends if peer != me)
        if sent:
            self._record("send_recv", sent, group)
        works = self._launch("send_recv (batch_isend_irecv)", group,
                             lambda: dist.batch_isend_irecv(ops) if ops else [], async_op=True)
        return self._finish(async_op, works, lambda: outputs)

    @staticmethod
    def _trivial(result, async_op):
        return CompletedHandle(result) if async_op else result


def _reduce_stack(blocks, op, n):
    """Reduce the leading (rank) dim of ``blocks`` in rank order."""
    if op in ("sum", "avg"):
        out = blocks.sum(0)
        return out / n if op == "avg" else out
    return blocks.amax(0) if op == "max" else blocks.amin(0)
