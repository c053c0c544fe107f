"""The raw collectives as functional collectives while torch.compile traces (docs/compile.md).

Under tracing a collective must be a graph node: ``torch.ops._c10d_functional.*`` take a tensor
and a group name and return a new tensor, which ``wait_tensor`` completes. ``collectives.py``
routes here when ``tracing(tensor)`` holds, so core's redistributions and its autograd
functions (forward and backward) are traced into the compiled graph and inductor schedules them.
Semantics match the eager paths: blocks in a group's creation order, the same dims, the same
reduce ops (avg as sum / n, as gloo's eager path does), and the same byte accounting.
"""
from typing import Any
import torch
import torch.distributed as dist

from hyper_parallel.platform.handles import CompletedHandle

_C10D = torch.ops._c10d_functional
_OPS = {"sum": "sum", "avg": "sum", "max": "max", "min": "min"}


def tracing(tensor: Any) -> bool:
    """Whether ``tensor`` is being traced by torch.compile (dynamo's fake example values, or
    AOTAutograd's functional / fake tensors): then no eager collective can run on it."""
    if not torch.compiler.is_compiling():
        return False
    from torch._subclasses.fake_tensor import is_fake
    from torch._subclasses.functional_tensor import FunctionalTensor
    return isinstance(tensor, FunctionalTensor) or is_fake(tensor)


def _wait(tensor):
    return _C10D.wait_tensor(tensor)


def _finish(result, async_op):
    return CompletedHandle(result) if async_op else result


def _name(group) -> str:
    return getattr(group or dist.group.WORLD, "group_name")


def all_gather(comm: Any, tensor: Any, group: Any, dim: Any, async_op: Any) -> Any:
    """``tensor``'s pieces of all ranks concatenated along ``dim`` (creation order)."""
    n = dist.get_world_size(group)
    moved = tensor.movedim(dim, 0).contiguous()
    comm._record("all_gather", (n - 1) * moved.numel() * moved.element_size(), group)
    out = _wait(_C10D.all_gather_into_tensor(moved, n, _name(group)))
    perm = comm._order(group)
    if perm is not None:
        out = out.unflatten(0, (n, moved.shape[0]))[perm[0]].flatten(0, 1)
    return _finish(out.movedim(0, dim).contiguous(), async_op)


def _exchange(comm, blocks, group):
    """One all-to-all of equal leading-dim blocks (already in torch's rank order)."""
    n = blocks.shape[0]
    flat = blocks.reshape(n, -1).contiguous()
    size = flat.shape[1]
    out = _wait(_C10D.all_to_all_single(flat.reshape(-1), [size] * n, [size] * n, _name(group)))
    return out.reshape(blocks.shape)


def all_to_all_single(comm: Any, blocks: Any, perm: Any, group: Any, concat_dim: Any, async_op: Any) -> Any:
    """The exchange of ``Collectives.all_to_all_single`` after its checks and block split."""
    comm._record("all_to_all", blocks.numel() * blocks.element_size() * (blocks.shape[0] - 1)
                 // blocks.shape[0], group)
    out = _exchange(comm, blocks, group)
    received = out if perm is None else out[perm[0]]
    return _finish(received.movedim(0, concat_dim).flatten(concat_dim, concat_dim + 1).contiguous(),
                   async_op)


def reduce_scatter(comm: Any, blocks: Any, perm: Any, group: Any, op: Any, reduce_stack: Any,
                   async_op: Any) -> Any:
    """All-to-all of the blocks, then the reduction in rank order (the eager gloo path's bytes)."""
    n = blocks.shape[0]
    comm._record("reduce_scatter", blocks.numel() * blocks.element_size() * (n - 1) // n, group)
    received = _exchange(comm, blocks, group)
    return _finish(reduce_stack(received if perm is None else received[perm[0]], op, n), async_op)


def all_reduce(comm: Any, tensor: Any, group: Any, op: Any, async_op: Any, tag: Any) -> Any:
    n = dist.get_world_size(group)
    out = tensor.contiguous()
    comm._record(tag or "all_reduce", 2 * out.numel() * out.element_size() * (n - 1) // n, group)
    if op in ("max", "min") and out.is_floating_point():
        # NaN-propagating, as the eager path: a NaN flag rides in the same reduction
        flag = torch.isnan(out).to(out.dtype)
        packed = _wait(_C10D.all_reduce(torch.stack([out, flag if op == "max" else -flag]), op,
                                        _name(group)))
        return _finish(torch.where(packed[1] != 0, torch.full_like(packed[0], float("nan")), packed[0]),
                       async_op)
    result = _wait(_C10D.all_reduce(out, _OPS[op], _name(group)))
    return _finish(result / n if op == "avg" else result, async_op)


def broadcast(comm: Any, tensor: Any, src: Any, group: Any, async_op: Any) -> Any:
    """The source rank's value on every rank: an all-reduce of it and zeros elsewhere (there is
    no functional broadcast)."""
    out = tensor.contiguous()
    if dist.get_rank() == src:
        comm._record("broadcast", out.numel() * out.element_size(), group)
    mine = out if dist.get_rank() == src else torch.zeros_like(out)
    return _finish(_wait(_C10D.all_reduce(mine, "sum", _name(group))), async_op)


def _group_index(group: Any, peer: int) -> int:
    return peer if group is None or group is dist.group.WORLD else dist.get_group_rank(group, peer)


def p2p_exchange(comm: Any, sends: Any, recvs: Any, group: Any, async_op: bool) -> Any:
    """The ring's hops while traced: one all-to-all whose only non-empty splits are the peers'
    (the same bytes as the eager isend / irecv pairs). A collective needs every rank of the group
    to make the same calls: the ring's asynchronous exchanges do (every rank takes the same steps,
    on the world group when none is named); the synchronous call sites (linear attention's state
    exchange, the load-balance swap) do not, and stay a compile boundary (``collectives.py``
    routes only ``async_op`` exchanges with sends and receives here; docs/compile.md)."""
    me, n = dist.get_rank(), dist.get_world_size(group)
    to_self = [t for t, peer in sends if peer == me]
    pieces: list = [[] for _ in range(n)]
    in_splits = [0] * n
    for tensor, peer in sends:
        if peer != me:
            flat = tensor.contiguous().reshape(-1)
            pieces[_group_index(group, peer)].append(flat)
            in_splits[_group_index(group, peer)] += flat.numel()
    outputs: list = [None] * len(recvs)
    expected: list = [[] for _ in range(n)]
    out_splits = [0] * n
    for slot, (template, peer) in enumerate(recvs):
        if peer == me:   # a ring of one rank: a copy
            outputs[slot] = to_self.pop(0).clone(memory_format=torch.contiguous_format)
            continue
        expected[_group_index(group, peer)].append((slot, template.shape))
        out_splits[_group_index(group, peer)] += template.numel()
    if len({t.dtype for t, _ in list(sends) + list(recvs)}) != 1:
        unsupported("p2p_exchange of several dtypes")
    flat = [p for per_peer in pieces for p in per_peer]
    send = torch.cat(flat) if flat else recvs[0][0].new_empty(0)
    if sum(in_splits):
        comm._record("send_recv", sum(in_splits) * send.element_size(), group)
    received = _wait(_C10D.all_to_all_single(send, out_splits, in_splits, _name(group)))
    offset = 0
    for per_source in expected:   # by source rank, in the order each source sent them
        for slot, shape in per_source:
            count = int(torch.Size(shape).numel())
            outputs[slot] = received[offset:offset + count].view(shape)
            offset += count
    return CompletedHandle(outputs) if async_op else outputs


def unsupported(op: str) -> Any:
    """Collectives with no functional form here (synchronous point-to-point exchanges)."""
    raise NotImplementedError(
        f"{op} cannot be traced by torch.compile here (a point-to-point exchange whose ranks may make "
        f"different calls); run this part eagerly: the load-balance / zigzag swap and linear attention's "
        f"exchanges are documented compile boundaries (docs/compile.md)")
