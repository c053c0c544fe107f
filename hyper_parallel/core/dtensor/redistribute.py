"""Redistribution: run the planned collectives that take a local shard from one layout to another.

:class:`~hyper_parallel.core.dtensor.redistribute_plan.RedistributePlanner` turns a pair of layouts
into steps of one collective each; plans are cached here per (mesh, coordinate, shape, src, dst).
Execution pads uneven shards (``torch.chunk`` sizes) to equal blocks for the collective and trims
them after, so every step stays one collective.
"""
from typing import Any
import functools

from hyper_parallel.core.dtensor.layout import chunk_sizes
from hyper_parallel.core.dtensor.redistribute_plan import RedistributePlanner, StepKind
from hyper_parallel.platform import get_platform


@functools.lru_cache(maxsize=4096)
def _plan(mesh_shape, coordinate, shape, src, dst):
    return RedistributePlanner(mesh_shape, coordinate, shape, src, dst).plan()


def plan_redistribute(mesh: Any, shape: Any, src: Any, dst: Any) -> Any:
    """The cached plan taking ``src`` placements to ``dst`` for a tensor of global ``shape``."""
    return _plan(mesh.mesh_shape, mesh.get_coordinate(), tuple(shape), tuple(src), tuple(dst))


# ----------------------------------------------------------------------------- execution
def _pad_to(tensor, dim, size):
    missing = size - tensor.shape[dim]
    if missing <= 0:
        return tensor
    pad_shape = list(tensor.shape)
    pad_shape[dim] = missing
    filler = get_platform().zeros(tuple(pad_shape), dtype=tensor.dtype, device=tensor.device)
    return get_platform().cat([tensor, filler], dim)


def _narrow(tensor, dim, start, length):
    """``tensor.narrow(dim, start, length)`` by basic slicing, which (unlike MindSpore's narrow)
    also takes the empty piece at the end of a dim (start == size, length 0)."""
    return tensor[(slice(None),) * dim + (slice(start, start + length),)]


def _trim_blocks(tensor, dim, block, sizes):
    """Keep the first sizes[i] entries of each length-``block`` block along ``dim``."""
    if all(s == block for s in sizes):
        return tensor
    pieces = [_narrow(tensor, dim, i * block, s) for i, s in enumerate(sizes)]
    return get_platform().cat(pieces, dim)


def _split_chunks_padded(tensor, dim, parts):
    """Pad ``dim`` so that torch.chunk pieces become equal blocks placed side by side."""
    sizes = chunk_sizes(tensor.shape[dim], parts)
    block = max(sizes) if sizes else 0
    if all(s == block for s in sizes):
        return tensor, block
    pieces, start = [], 0
    for s in sizes:
        pieces.append(_pad_to(_narrow(tensor, dim, start, s), dim, block))
        start += s
    return get_platform().cat(pieces, dim), block


def _run_step(step, local, mesh):
    platform = get_platform()
    group = mesh.get_group(step.mesh_dim)
    me = mesh.get_coordinate()[step.mesh_dim]
    n = mesh.mesh_shape[step.mesh_dim]
    if step.kind == StepKind.ALL_GATHER:
        block = max(step.sizes)
        out = platform.all_gather(_pad_to(local, step.dim, block), group, step.dim)
        return _trim_blocks(out, step.dim, block, step.sizes)
    if step.kind == StepKind.ALL_TO_ALL:
        padded, new_block = _split_chunks_padded(local, step.new_dim, n)
        block = max(step.sizes)
        padded = _pad_to(padded, step.dim, block)
        out = platform.all_to_all_single(padded, group, split_dim=step.new_dim, concat_dim=step.dim)
        out = _trim_blocks(out, step.dim, block, step.sizes)
        return _narrow(out, step.new_dim, 0, step.new_sizes[me])
    if step.kind == StepKind.REDUCE_SCATTER:
        padded, block = _split_chunks_padded(local, step.dim, n)
        out = platform.reduce_scatter(padded, group, step.dim, step.op)
        return _narrow(out, step.dim, 0, step.sizes[me])
    if step.kind == StepKind.ALL_REDUCE:
        return platform.all_reduce(local, group, step.op)
    if step.kind == StepKind.LOCAL_CHUNK:
        start, length = step.sizes
        return _narrow(local, step.dim, start, length).contiguous()
    if step.kind == StepKind.TO_PARTIAL:
        return _partition(local, step.op, me, n)
    raise AssertionError(step.kind)


def _partition(local, op, me, n):
    """Replicate -> Partial(op) on one mesh dim of ``n`` ranks, as PyTorch's ``Partial`` does it:
    a sum is split into equal shares ``v / n`` on every rank (so each rank's piece has the scale of
    its share, and work done on it is balanced); avg, max and min keep ``v`` (exact). Integer and
    bool values cannot be divided exactly: they keep ``v`` on the first rank and zeros elsewhere."""
    if op != "sum":
        return local
    platform = get_platform()
    if platform.is_floating_point(local):
        return local / n
    return local if me == 0 else platform.zeros_like(local)


def redistribute_local(local: Any, mesh: Any, shape: Any, src: Any, dst: Any) -> Any:
    """Move ``local`` (the shard of a ``shape`` tensor laid out as ``src``) to layout ``dst``."""
    if mesh.get_coordinate() is None:
        return local  # a rank outside the mesh keeps its empty piece and joins no collective (PyTorch)
    for step in plan_redistribute(mesh, shape, src, dst):
        local = _run_step(step, local, mesh)
    return local
