"""The way in of Ulysses and all-gather KV: where q, k, v live in each mode, and how they get there.

1. Placements (``input_placements``, ``mode_placements``). The sequence arrives split over the CP
   mesh dims (contiguous blocks). A mode moves some of those splits from the sequence to the heads
   (Ulysses, one all-to-all) and gathers the rest for K/V (all-gather KV). Placements are derived
   from shard orders, so they compose with any other split already on the tensor (TP heads, a
   StridedShard where CP splits heads inside TP's split).

2. The fused all-to-all (``QKVAllToAll``): q, k and v moved sequence -> heads by one all-to-all, run
   whole (one autograd function, forward and backward) or split in two (``start`` / ``finish``).

   Each rank's send buffer holds, for every destination rank j, [q heads block j | k block j |
   v block j] side by side on the head dim (q and k/v may differ in head count: GQA), so the one
   all-to-all hands rank j every rank's blocks of its heads, and the results are slices of what
   arrives. Built by one ``cat`` of rank-block views, the send buffer is the only copy forward
   makes: the all-to-all runs on its leading (rank) dim, so the platform needs no staging copy of
   its own, and each result is a view of the received buffer (rank j's block is sequence block j:
   merging the rank dim into the sequence dim is free when no dim before the sequence is longer
   than 1, e.g. BSHD with batch 1; else the reshape copies once, as a per-tensor all-to-all would).
   Backward mirrors it: the gradients are written into one buffer in the received layout, one
   all-to-all sends them back, and each input's gradient is one copy out of it. The results are
   DTensors whose gradients are taken in their own layouts, as ``DTensor.from_local`` does.
   ``start`` launches the same packed tensor through the platform's split collectives and returns
   ``finish``, so compute runs while it travels (overlap).

3. The moves chosen (``mode_dtensors``, ``to_mode``): q, k and v from their sequence-split input
   layout to the mode's layout, in as few collectives as the layout allows. Moved one by one,
   Ulysses runs three all-to-alls (q, k, v) and all-gather KV two all-gathers (k, v), in forward
   and again in backward. Where every tensor's move is the same single even collective on
   the same mesh dim (the redistribution planner says so), they travel in one: the q/k/v all-to-all
   (2. above), then the k/v all-gather (kv_all_gather.py). Anything else (uneven blocks, a
   plan of several steps, mismatched dims or dtypes) takes the per-tensor redistribution, which is
   always correct. What to do for a signature is decided once and cached (``_Moves``), so a
   steady-state call only runs the moves.
"""
from typing import Any

from hyper_parallel.core.autograd_functions import lazy_autograd_function
from hyper_parallel.core.bounded_cache import BoundedCache, lifetime_key
from hyper_parallel.core.context_parallel.movement.kv_all_gather import KVAllGather
from hyper_parallel.core.context_parallel.movement.steps import Block, shared_step
from hyper_parallel.core.dtensor.dtensor import DTensor, as_layout
from hyper_parallel.core.dtensor.layout import grad_placements, placements_from_orders, shard_orders
from hyper_parallel.core.dtensor.mesh_registry import remember_mesh
from hyper_parallel.core.dtensor.placement_types import Replicate
from hyper_parallel.core.dtensor.spec import DTensorSpec
from hyper_parallel.platform import get_platform


# ============================================================== 1. placements
def _orders(placements, mesh, ndim):
    return [list(o) for o in shard_orders(placements, mesh.mesh_shape, ndim)]


def _non_shard(placements):
    return [Replicate() if p.is_shard() else p for p in placements]


_INPUT = BoundedCache(4096)


def input_placements(mesh: Any, ndim: Any, seq_dim: Any, cp_dims: Any, other: Any = None) -> Any:
    """Contiguous sequence blocks over ``cp_dims`` (outer first), plus ``other`` placements.
    Cached per arguments (every ContextParallel call asks, with the same few each step)."""
    key = (lifetime_key(mesh), ndim, seq_dim, tuple(cp_dims), None if other is None else tuple(other))
    found = _INPUT.get(key)
    if found is None:
        found = _INPUT[key] = _input_placements(mesh, ndim, seq_dim, cp_dims, other)
    return found


def _input_placements(mesh, ndim, seq_dim, cp_dims, other):
    placements = list(other) if other is not None else [Replicate()] * mesh.ndim
    orders = _orders(placements, mesh, ndim)
    orders[seq_dim] = list(cp_dims) + orders[seq_dim]
    return placements_from_orders(orders, _non_shard(placements), mesh.mesh_shape)


def mode_placements(placements: Any, mesh: Any, ndim: Any, seq_dim: Any, head_dim: Any, ulysses_dims: Any,
                    gather_dims: Any) -> Any:
    """(q placements, k/v placements) for attention: ``ulysses_dims`` move from the sequence to the
    heads (innermost), then K/V are replicated over ``gather_dims``."""
    orders = _orders(placements, mesh, ndim)
    for m in reversed(ulysses_dims):
        if not orders[seq_dim] or orders[seq_dim][-1] != m:
            raise ValueError(f"mesh dim {m} does not hold the innermost sequence split of {placements}")
        orders[seq_dim].pop()
    for m in ulysses_dims:
        orders[head_dim].append(m)
    non_shard = _non_shard(placements)
    q = placements_from_orders(orders, non_shard, mesh.mesh_shape)
    for m in reversed(gather_dims):
        if orders[seq_dim] and orders[seq_dim][-1] == m:
            orders[seq_dim].pop()
    kv = placements_from_orders(orders, non_shard, mesh.mesh_shape)
    return q, kv


def seq_split(placements: Any, seq_dim: Any) -> Any:
    return [m for m, p in enumerate(placements) if p.is_shard(seq_dim)]


# ============================================================== 2. the fused q/k/v all-to-all
def _split(t, dim, n):
    """``t`` with ``dim`` cut into n equal blocks, the block index moved to a new leading dim (a view)."""
    shape = list(t.shape)
    return t.reshape(tuple(shape[:dim] + [n, shape[dim] // n] + shape[dim + 1:])).movedim(dim, 0)


def _merge(t, dim):
    """Inverse of ``_split``: the leading block dim folded back into ``dim`` (a view where strides allow)."""
    t = t.movedim(0, dim)
    shape = list(t.shape)
    return t.reshape(tuple(shape[:dim] + [shape[dim] * shape[dim + 1]] + shape[dim + 2:]))


def _pieces(buffer, dim, widths):
    """Consecutive slices of ``buffer`` along ``dim`` of the given widths (views)."""
    out, start = [], 0
    for w in widths:
        out.append(buffer[(slice(None),) * dim + (slice(start, start + w),)])
        start += w
    return out


def _equal_but(shapes, dim):
    shapes = [list(s) for s in shapes]
    for s in shapes:
        s[dim] = 0
    return all(s == shapes[0] for s in shapes)


class QKVAllToAll:
    """Tensors ``indices`` of q, k, v, equal but in head count, moved by one all-to-all."""

    __slots__ = ("mesh", "indices", "group", "n", "seq", "head", "widths", "targets", "specs", "grad_specs")

    def __init__(self, mesh: Any, indices: Any, step: Any, widths: Any, targets: Any, shapes: Any) -> None:
        self.mesh, self.indices = mesh, tuple(indices)
        self.group, self.n = mesh.get_group(step.mesh_dim), mesh.mesh_shape[step.mesh_dim]
        self.seq, self.head = step.dim, step.new_dim
        self.widths, self.targets = tuple(widths), [tuple(t) for t in targets]
        self.specs = tuple(DTensorSpec(mesh, t, tuple(s)) for t, s in zip(self.targets, shapes))
        self.grad_specs = tuple(s.with_placements(grad_placements(s.placements)) for s in self.specs)

    @classmethod
    def plan(cls, mesh: Any, shapes: Any, sources: Any, targets: Any, local_shapes: Any, dtypes: Any,
             indices: Any = (0, 1, 2)) -> Any:
        """The move of the tensors at ``indices`` (global ``shapes``, ``sources`` -> ``targets``,
        this rank's ``local_shapes`` and ``dtypes``, all indexed like q, k, v), or None where it is
        not one even sequence -> heads all-to-all of blocks of one dtype equal but in heads."""
        pick = lambda seq: [seq[i] for i in indices]  # noqa: E731
        step = shared_step(mesh, pick(shapes), pick(sources), pick(targets), "all_to_all")
        if step is None or len(set(pick(dtypes))) != 1:
            return None
        n, local = mesh.mesh_shape[step.mesh_dim], [tuple(s) for s in pick(local_shapes)]
        if (len({len(s) for s in local}) != 1 or not _equal_but(local, step.new_dim)
                or any(s[step.new_dim] % n for s in local)):
            return None
        return cls(mesh, indices, step, [s[step.new_dim] // n for s in local], pick(targets), pick(shapes))

    def run(self, locals_: Any) -> Any:
        """The moved tensors' DTensors (one differentiable all-to-all)."""
        platform = get_platform()
        if not (platform.is_grad_enabled() and any(platform.requires_grad(t) for t in locals_)):
            return list(_forward(_NoCtx(), self, *locals_))   # nothing to record: no autograd node
        return list(_FUNCTION(self, *locals_))

    def start(self, blocks: Any, observer: Any = None) -> Any:
        """Launch the move of ``blocks[i]`` for i in ``indices``; returns ``finish`` -> all blocks."""
        platform = get_platform()
        split = self.head
        parts = []
        for i in self.indices:
            shape = list(blocks[i].local.shape)
            parts.append(blocks[i].local.reshape(tuple(shape[:split] + [self.n, shape[split] // self.n]
                                                       + shape[split + 1:])))
        packed = platform.cat(parts, split + 1)
        shape = list(packed.shape)
        packed = packed.reshape(tuple(shape[:split] + [shape[split] * shape[split + 1]] + shape[split + 2:]))
        pending = platform.start_differentiable_collective("all_to_all", packed, self.group,
                                                           (split, self.seq), observer)

        def finish():
            # one split (its backward is one concatenation, not a zero-filled buffer per piece)
            pieces, out = pending.wait().split(list(self.widths), split), list(blocks)
            for i, piece, placements in zip(self.indices, pieces, self.targets):
                out[i] = Block(piece, placements, blocks[i].shape)
            return out
        return finish


def _forward(ctx, plan, *locals_):
    platform = get_platform()
    ctx.plan = plan
    # the send buffer (n, ..., heads of every tensor / n, ...): the one forward copy
    send = platform.cat([_split(t, plan.head, plan.n) for t in locals_], plan.head + 1)
    received = platform.all_to_all_single(send, plan.group, 0, 0)
    ctx.dtype, ctx.device = send.dtype, getattr(send, "device", None)
    return tuple(DTensor._make(_merge(piece, plan.seq), spec) for piece, spec in
                 zip(_pieces(received, plan.head + 1, plan.widths), plan.specs))


def _backward(ctx, *grads):
    platform = get_platform()
    plan = ctx.plan
    parts = []
    for grad, spec, grad_spec in zip(grads, plan.specs, plan.grad_specs):
        if grad is None:   # a result that reached no loss (frameworks that pass None for it)
            grad = platform.zeros(tuple(spec.local_shape), dtype=ctx.dtype, device=ctx.device)
        elif isinstance(grad, DTensor):
            # as DTensor.from_local's backward; a gradient already in place needs no plan lookup
            same = grad._spec.placements == grad_spec.placements and grad._spec.shape == grad_spec.shape
            grad = grad._local_tensor if same else as_layout(grad, grad_spec)._local_tensor
        parts.append(_split(grad, plan.seq, plan.n))
    # the received layout, all gradients side by side: one copy each, one all-to-all back
    sent_back = platform.all_to_all_single(platform.cat(parts, plan.head + 1), plan.group, 0, 0)
    out = [_merge(piece, plan.head).contiguous() for piece in _pieces(sent_back, plan.head + 1, plan.widths)]
    return (None,) + tuple(out)


class _NoCtx:
    pass


_FUNCTION = lazy_autograd_function("QKVAllToAll", _forward, _backward)


# ============================================================== 3. the moves, chosen per signature
_MOVES = BoundedCache(4096)


class _Moves:
    """Per signature: the staged (Ulysses) and final placements, the tensors the all-to-all moves
    and its fused move (None: per-tensor redistribution)."""

    __slots__ = ("mesh", "staged", "targets", "pending", "all_to_all")

    def __init__(self, mesh, staged, targets, pending, all_to_all):
        self.mesh, self.staged, self.targets, self.pending = mesh, staged, targets, pending
        self.all_to_all = all_to_all


def _moves(mesh, locals_, placements, shapes, seq, head, ulysses_dims, gather_dims):
    key = (lifetime_key(mesh), tuple(tuple(p) for p in placements), tuple(tuple(s) for s in shapes),
           tuple((tuple(t.shape), t.dtype) for t in locals_), seq, head, tuple(ulysses_dims),
           tuple(gather_dims))
    moves = _MOVES.get(key)
    if moves is not None:
        return moves
    ndim = len(shapes[0])
    targets = [mode_placements(p, mesh, ndim, seq, head, ulysses_dims, gather_dims) for p in placements]
    targets = [targets[0][0]] + [kv for _, kv in targets[1:]]
    staged = [mode_placements(p, mesh, ndim, seq, head, ulysses_dims, [])[0] for p in placements]
    pending = [i for i, (p, s) in enumerate(zip(placements, staged)) if tuple(p) != tuple(s)]
    fused = None
    if ulysses_dims and len(pending) > 1:
        fused = QKVAllToAll.plan(mesh, shapes, placements, staged, [tuple(t.shape) for t in locals_],
                                 [t.dtype for t in locals_], pending)
    moves = _MOVES[key] = _Moves(remember_mesh(mesh), staged, targets, pending, fused)
    return moves


def _gather_kv(dts, targets):
    """k and v DTensors moved to ``targets``: one fused all-gather where possible."""
    pending = [i for i, (dt, p) in enumerate(zip(dts, targets)) if tuple(dt.placements) != tuple(p)]
    if len(pending) == len(dts) == 2:
        mesh = dts[0].device_mesh
        gather = KVAllGather.plan(mesh, [dt.shape for dt in dts], [dt.placements for dt in dts], targets,
                                  [dt.dtype for dt in dts], (0, 1))
        if gather is not None:
            return gather.run(dts)
    return [dt.redistribute(placements=p) for dt, p in zip(dts, targets)]


def mode_dtensors(mesh: Any, locals_: Any, placements: Any, shapes: Any, seq: Any, head: Any,
                  ulysses_dims: Any, gather_dims: Any) -> Any:
    """q, k, v local blocks (this rank's share of global ``shapes`` laid out as ``placements`` on
    ``mesh``, the sequence-split input layout) as DTensors in the mode's layout: the Ulysses
    all-to-all of all three fused into one, then k and v gathered over ``gather_dims`` in one."""
    moves = _moves(mesh, locals_, placements, shapes, seq, head, ulysses_dims, gather_dims)
    if moves.all_to_all is not None:
        moved = [DTensor.from_local(t, mesh, p, shape=s) if i not in moves.pending else None
                 for i, (t, p, s) in enumerate(zip(locals_, placements, shapes))]
        for i, dt in zip(moves.pending, moves.all_to_all.run([locals_[i] for i in moves.pending])):
            moved[i] = dt
    else:
        moved = [DTensor.from_local(t, mesh, p, shape=s).redistribute(placements=staged)
                 for t, p, s, staged in zip(locals_, placements, shapes, moves.staged)]
    if not gather_dims:
        return moved
    return moved[:1] + _gather_kv(moved[1:], moves.targets[1:])


def to_mode(dts: Any, seq: Any, head: Any, ulysses_dims: Any, gather_dims: Any, fuse: bool = True) -> Any:
    """q, k, v DTensors (in their sequence-split input layout) in the mode's layout, fused as
    ``mode_dtensors`` (``fuse=False``: one collective per tensor, so only one tensor's staging
    buffers are alive at a time)."""
    mesh, ndim = dts[0].device_mesh, dts[0].ndim
    if not fuse:
        targets = [mode_placements(dt.placements, mesh, ndim, seq, head, ulysses_dims, gather_dims)
                   for dt in dts]
        targets = [targets[0][0]] + [kv for _, kv in targets[1:]]
        return [dt.redistribute(placements=p) for dt, p in zip(dts, targets)]
    return mode_dtensors(mesh, [dt.to_local() for dt in dts], [dt.placements for dt in dts],
                         [dt.shape for dt in dts], seq, head, ulysses_dims, gather_dims)


__all__ = ["QKVAllToAll", "input_placements", "mode_dtensors", "mode_placements", "seq_split", "to_mode"]
