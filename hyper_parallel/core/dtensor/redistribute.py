"""Redistribution: plan the cheapest sequence of collectives between two layouts, then run it.

The planner works on *shard orders* (per tensor dim, the mesh dims splitting it, innermost last):

0. Local slices that are possible right away come first, then the all-reduces of Partial mesh
   dims that stay unsharded, so later collectives move less.
1. Shards that must go are taken off innermost first. A mesh dim that moves from Shard(d) to
   Shard(e) is one all-to-all when it can become the innermost split of e; otherwise target shards
   that are ready are added first (as in 2), and only then is it all-gathered.
2. Missing shards are added outermost first: Replicate -> Shard is a local slice, Partial -> Shard
   one reduce-scatter (slices before reduce-scatters).
3. What is left: Replicate -> Partial local.

Uneven shards (``torch.chunk`` sizes) are padded to equal blocks for the collective and trimmed
after, so every step stays one collective. Plans are cached per (mesh, shape, src, dst).
"""
import functools
from dataclasses import dataclass

from hyper_parallel.core.dtensor.layout import (chunk_range, chunk_sizes, dim_range, placements_from_orders,
                                                shard_orders)
from hyper_parallel.core.dtensor.placement_types import HeadTailShard, Partial, Replicate, Shard
from hyper_parallel.platform import get_platform


@dataclass(frozen=True)
class Step:
    kind: str          # all_gather | all_to_all | reduce_scatter | all_reduce | local_chunk | to_partial
    mesh_dim: int
    dim: int = -1      # tensor dim gathered / reduced over / chunked
    new_dim: int = -1  # all_to_all: the tensor dim that becomes split
    op: str = "sum"
    sizes: tuple = ()  # chunk sizes of `dim` over the mesh dim's ranks (before the step)
    new_sizes: tuple = ()  # chunk sizes of `new_dim` over the mesh dim's ranks


def _state_of(placement):
    if placement.is_shard():
        return None
    return placement


@functools.lru_cache(maxsize=4096)
def _plan(mesh_shape, coordinate, shape, src, dst):
    if src == dst:
        return ()
    if any(isinstance(p, HeadTailShard) for p in src) or \
            any(isinstance(p, HeadTailShard) and not src[m].is_replicate() for m, p in enumerate(dst)):
        raise ValueError(f"cannot redistribute {src} -> {dst}: a HeadTailShard (load-balanced half) "
                         f"covers only half the tensor; only Replicate -> HeadTailShard is possible")
    ndim = len(shape)
    orders = shard_orders(src, mesh_shape, ndim)
    target = shard_orders(dst, mesh_shape, ndim)
    state = [_state_of(p) for p in src]  # None while the mesh dim shards something
    steps = []

    def sizes(dim, m):
        _, size = dim_range(shape[dim], orders[dim], layout_of(), mesh_shape, coordinate)
        return tuple(chunk_sizes(size, mesh_shape[m]))

    def parent_sizes(dim, m):
        # sizes of `dim` over mesh dim m's ranks, with m the innermost split of `dim`
        _, size = dim_range(shape[dim], orders[dim][:-1], layout_of(), mesh_shape, coordinate)
        return tuple(chunk_sizes(size, mesh_shape[m]))

    def layout_of():
        # chunking only depends on the kind of shard per mesh dim; HeadTail only appears in dst
        return tuple(dst[m] if isinstance(dst[m], HeadTailShard) else Shard(0) for m in range(len(src)))

    def stable_len(dim):
        n = 0
        while n < min(len(orders[dim]), len(target[dim])) and orders[dim][n] == target[dim][n]:
            n += 1
        return n

    def can_append(dim, m):
        return m in target[dim] and orders[dim] == target[dim][:target[dim].index(m)]

    def add_shards(local_only):
        """Add missing shards, outermost first per tensor dim; local slices before reduce-scatters
        (each slice shrinks what later collectives move). A mesh dim still sharding another tensor
        dim waits for phase 1."""
        while True:
            ready = [(e, target[e][len(orders[e])]) for e in range(ndim)
                     if len(orders[e]) < len(target[e]) and orders[e] == target[e][:len(orders[e])]]
            ready = [(e, m) for e, m in ready if state[m] is not None]
            local = [(e, m) for e, m in ready if not isinstance(state[m], Partial)]
            if not local and (local_only or not ready):
                return
            e, m = (local or ready)[0]
            if isinstance(state[m], Partial):
                steps.append(Step("reduce_scatter", m, e, op=state[m].reduce_op, sizes=sizes(e, m)))
            else:
                _, size = dim_range(shape[e], orders[e], layout_of(), mesh_shape, coordinate)
                index, parts = dst[m].chunk_of(coordinate[m], mesh_shape[m])
                start, length = chunk_range(0, size, parts, index)
                steps.append(Step("local_chunk", m, e, sizes=(start, length)))
            orders[e].append(m)
            state[m] = None

    # Phase 0: local slices that need nothing else first, then the all-reduces of Partial mesh dims
    # that do not become shards (on the smallest local tensor: before any all-gather grows it).
    add_shards(local_only=True)
    for m, want in enumerate(dst):
        if isinstance(state[m], Partial) and not want.is_shard() and state[m] != want:
            steps.append(Step("all_reduce", m, op=state[m].reduce_op))
            state[m] = Replicate()

    # Phase 1: take off shards that are not in the stable prefix, innermost first.
    while True:
        removable = [(d, orders[d][-1]) for d in range(ndim) if len(orders[d]) > stable_len(d)]
        if not removable:
            break
        moved = False
        for d, m in removable:
            e = dst[m].dim if dst[m].is_shard() else None
            if e is not None and e != d and can_append(e, m):
                steps.append(Step("all_to_all", m, d, e, sizes=parent_sizes(d, m), new_sizes=sizes(e, m)))
                orders[d].pop()
                orders[e].append(m)
                moved = True
                break
        if not moved:
            # Before gathering, add any target shard that is ready (a slice, or a reduce-scatter of
            # a Partial dim): it never grows the tensor, and it may let the shard move by all-to-all
            # ((P, S(h)) -> (S(s), S(s)): reduce-scatter, then all-to-all; not all-gather first).
            count = len(steps)
            add_shards(local_only=False)
            if len(steps) > count:
                continue
            d, m = removable[-1]
            steps.append(Step("all_gather", m, d, sizes=parent_sizes(d, m)))
            orders[d].pop()
            state[m] = Replicate()

    # Phase 2: add the missing shards.
    add_shards(local_only=False)

    # Phase 3: replicate / partial conversions.
    for m, want in enumerate(dst):
        have = state[m]
        if want.is_shard() or have == want:
            continue
        if isinstance(have, Partial):
            steps.append(Step("all_reduce", m, op=have.reduce_op))
        if isinstance(want, Partial):
            steps.append(Step("to_partial", m, op=want.reduce_op))
    return tuple(steps)


def plan_redistribute(mesh, shape, src, dst):
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
    if step.kind == "all_gather":
        block = max(step.sizes)
        out = platform.all_gather(_pad_to(local, step.dim, block), group, step.dim)
        return _trim_blocks(out, step.dim, block, step.sizes)
    if step.kind == "all_to_all":
        padded, new_block = _split_chunks_padded(local, step.new_dim, n)
        block = max(step.sizes)
        padded = _pad_to(padded, step.dim, block)
        out = platform.all_to_all_single(padded, group, split_dim=step.new_dim, concat_dim=step.dim)
        out = _trim_blocks(out, step.dim, block, step.sizes)
        return _narrow(out, step.new_dim, 0, step.new_sizes[me])
    if step.kind == "reduce_scatter":
        padded, block = _split_chunks_padded(local, step.dim, n)
        out = platform.reduce_scatter(padded, group, step.dim, step.op)
        return _narrow(out, step.dim, 0, step.sizes[me])
    if step.kind == "all_reduce":
        return platform.all_reduce(local, group, step.op)
    if step.kind == "local_chunk":
        start, length = step.sizes
        return _narrow(local, step.dim, start, length).contiguous()
    if step.kind == "to_partial":
        if step.op == "sum" and me != 0:
            return local.new_zeros(local.shape) if hasattr(local, "new_zeros") else local * 0
        return local
    raise AssertionError(step.kind)


def redistribute_local(local, mesh, shape, src, dst):
    """Move ``local`` (the shard of a ``shape`` tensor laid out as ``src``) to layout ``dst``."""
    if mesh.get_coordinate() is None:
        return local  # a rank outside the mesh keeps its empty piece and joins no collective (PyTorch)
    for step in plan_redistribute(mesh, shape, src, dst):
        local = _run_step(step, local, mesh)
    return local


def normalized_orders(placements, mesh_shape, ndim):
    """The canonical placements of a layout (StridedShard only where it is needed)."""
    orders = shard_orders(placements, mesh_shape, ndim)
    return placements_from_orders(orders, [p if not p.is_shard() else Replicate() for p in placements],
                                  mesh_shape)
