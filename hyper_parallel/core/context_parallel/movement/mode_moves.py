"""q, k and v moved from their sequence-split input layout to a mode's layout, in as few
collectives as the layout allows.

Moved one by one, Ulysses runs three all-to-alls (q, k, v) and all-gather KV two all-gathers (k, v),
in forward and again in backward. Where every tensor's move is the same single even collective on
the same mesh dim (the redistribution planner says so), they travel in one: the q/k/v all-to-all
(qkv_all_to_all.py), then the k/v all-gather (kv_all_gather.py). Anything else (uneven blocks, a
plan of several steps, mismatched dims or dtypes) takes the per-tensor redistribution, which is
always correct. What to do for a signature is decided once and cached (``_Moves``), so a
steady-state call only runs the moves.
"""
from typing import Any
from hyper_parallel.core.bounded_cache import BoundedCache
from hyper_parallel.core.context_parallel.layouts import mode_placements
from hyper_parallel.core.context_parallel.movement.kv_all_gather import KVAllGather
from hyper_parallel.core.context_parallel.movement.qkv_all_to_all import QKVAllToAll
from hyper_parallel.core.dtensor.mesh_registry import remember_mesh
from hyper_parallel.core.dtensor.dtensor import DTensor

_MOVES = BoundedCache(4096)


class _Moves:
    """Per signature: the staged (Ulysses) and final placements, the tensors the all-to-all moves
    and its fused move (None: per-tensor redistribution)."""

    __slots__ = ("mesh", "staged", "targets", "pending", "all_to_all")

    def __init__(self, mesh, staged, targets, pending, all_to_all):
        self.mesh, self.staged, self.targets, self.pending = mesh, staged, targets, pending
        self.all_to_all = all_to_all


def _moves(mesh, locals_, placements, shapes, seq, head, ulysses_dims, gather_dims):
    key = (id(mesh), tuple(tuple(p) for p in placements), tuple(tuple(s) for s in shapes),
           tuple((tuple(t.shape), t.dtype) for t in locals_), seq, head, tuple(ulysses_dims),
           tuple(gather_dims))
    moves = _MOVES.get(key)
    if moves is not None and moves.mesh is mesh:
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
    return moves   # keeps the mesh alive, so its id cannot be reused by another mesh


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
