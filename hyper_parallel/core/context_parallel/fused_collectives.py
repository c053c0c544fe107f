"""q, k and v moved to a mode's layout in as few collectives as the layout allows.

Moved one by one, Ulysses runs three all-to-alls (q, k, v) and all-gather KV two all-gathers
(k, v), in forward and again in backward. Where every tensor's move is the same single even
collective on the same mesh dim (the redistribution planner says so), the tensors travel in one:

* all-to-all (sequence -> heads): each tensor's head dim is cut into the n blocks the ranks will
  hold, and block j of q, k and v are laid side by side, so the one all-to-all hands rank j
  [q block j | k block j | v block j] from every rank; it splits them again by head counts.
  q and k/v may differ in head count (GQA) but must agree on every other dim and the dtype.
  One autograd function does it, forward and backward (qkv_all_to_all.py: one copy per tensor
  each way, one collective each way).
* all-gather (k, v on the gather dims): k and v stacked on a new leading dim, one all-gather,
  differentiable through the platform's collectives (backward: one reduce-scatter).

Anything else (uneven blocks, a plan of several steps, mismatched dims or dtypes) takes the
per-tensor redistribution, which is always correct. What to do for a signature (mesh, placements,
shapes, dtypes, dims) is decided once and cached, so a steady-state call only runs the moves.
"""
from hyper_parallel.core.context_parallel.layouts import mode_placements
from hyper_parallel.core.context_parallel.qkv_all_to_all import QKVPlan, move_qkv
from hyper_parallel.core.dtensor.checkpoint import remember_mesh
from hyper_parallel.core.dtensor.dtensor import DTensor
from hyper_parallel.core.dtensor.placement_types import Partial
from hyper_parallel.core.dtensor.redistribute import plan_redistribute
from hyper_parallel.core.dtensor.spec import DTensorSpec
from hyper_parallel.platform import get_platform

_PLANS = {}
_LIMIT = 4096


def single_step(mesh, shape, src, dst, kind):
    """The one even ``kind`` step that moves a ``shape`` tensor from ``src`` to ``dst``, or None."""
    steps = plan_redistribute(mesh, shape, src, dst)
    if len(steps) != 1 or steps[0].kind != kind:
        return None
    step = steps[0]
    if len(set(step.sizes)) > 1 or len(set(step.new_sizes)) > 1:
        return None
    return step


def _same_except(shapes, dim):
    shapes = [list(s) for s in shapes]
    for s in shapes:
        s[dim] = 0
    return all(s == shapes[0] for s in shapes)


def _qkv_plan(mesh, shapes, srcs, dsts, locals_, head):
    """The QKVPlan moving these tensors (global ``shapes``, local blocks ``locals_``) from ``srcs``
    to ``dsts`` by one all-to-all: one even step each, on one mesh dim, sequence -> ``head``, local
    blocks of one dtype that differ only in head count, every head count divisible. Else None."""
    steps = [single_step(mesh, shape, src, dst, "all_to_all") for shape, src, dst in zip(shapes, srcs, dsts)]
    if any(s is None for s in steps) or len({(s.mesh_dim, s.dim, s.new_dim) for s in steps}) != 1:
        return None
    step = steps[0]
    n = mesh.mesh_shape[step.mesh_dim]
    local_shapes = [tuple(t.shape) for t in locals_]
    if (step.new_dim != head or len({t.dtype for t in locals_}) != 1
            or len({len(s) for s in local_shapes}) != 1
            or not _same_except(local_shapes, head) or any(s[head] % n for s in local_shapes)):
        return None
    specs = [DTensorSpec(mesh, tuple(dst), tuple(shape)) for shape, dst in zip(shapes, dsts)]
    widths = [s[head] // n for s in local_shapes]
    return QKVPlan(mesh.get_group(step.mesh_dim), n, step.dim, head, widths, specs)


class _ModePlan:
    """Per signature: the staged (Ulysses) and final placements, the tensors the all-to-all moves
    and how (a QKVPlan, or None for per-tensor redistribution)."""

    __slots__ = ("mesh", "staged", "targets", "pending", "qkv")

    def __init__(self, mesh, staged, targets, pending, qkv):
        self.mesh, self.staged, self.targets, self.pending, self.qkv = mesh, staged, targets, pending, qkv


def _mode_plan(mesh, locals_, placements, shapes, seq, head, ulysses_dims, gather_dims):
    key = (id(mesh), tuple(tuple(p) for p in placements), tuple(tuple(s) for s in shapes),
           tuple((tuple(t.shape), t.dtype) for t in locals_), seq, head, tuple(ulysses_dims),
           tuple(gather_dims))
    plan = _PLANS.get(key)
    if plan is not None and plan.mesh is mesh:
        return plan
    ndim = len(shapes[0])
    targets = [mode_placements(p, mesh, ndim, seq, head, ulysses_dims, gather_dims) for p in placements]
    targets = [targets[0][0]] + [kv for _, kv in targets[1:]]
    staged = [mode_placements(p, mesh, ndim, seq, head, ulysses_dims, [])[0] for p in placements]
    pending = [i for i, (p, s) in enumerate(zip(placements, staged)) if tuple(p) != tuple(s)]
    qkv = None
    if ulysses_dims and len(pending) > 1:
        qkv = _qkv_plan(mesh, [shapes[i] for i in pending], [placements[i] for i in pending],
                        [staged[i] for i in pending], [locals_[i] for i in pending], head)
    plan = _ModePlan(remember_mesh(mesh), staged, targets, pending, qkv)
    if len(_PLANS) >= _LIMIT:
        _PLANS.clear()
    _PLANS[key] = plan   # keeps the mesh alive, so its id cannot be reused by another mesh
    return plan


def _fused_all_gather(dts, targets, steps):
    """One all-gather of k and v stacked on a new leading dim (each result a contiguous slice)."""
    platform = get_platform()
    step = steps[0]
    mesh = dts[0].device_mesh
    locals_ = [dt.to_local() for dt in dts]
    if len({tuple(t.shape) for t in locals_}) != 1 or len({t.dtype for t in locals_}) != 1:
        return None
    stacked = platform.cat([t.unsqueeze(0) for t in locals_], 0)
    gathered = platform.differentiable_all_gather(stacked, mesh.get_group(step.mesh_dim), step.dim + 1)
    out = []
    for i, (dt, placements) in enumerate(zip(dts, targets)):
        # each rank's queries give a share of the gathered K/V's gradient: take it as Partial on
        # the gathered dim, which the all-gather's backward (a reduce-scatter) sums exactly once
        grads = list(placements)
        grads[step.mesh_dim] = Partial()
        out.append(DTensor.from_local(gathered[i], mesh, placements, shape=dt.shape, grad_placements=grads))
    return out


def _gather_kv(dts, targets):
    """k and v DTensors moved to ``targets``: one fused all-gather where possible."""
    pending = [i for i, (dt, p) in enumerate(zip(dts, targets)) if tuple(dt.placements) != tuple(p)]
    if len(pending) == len(dts) == 2:
        steps = [single_step(dt.device_mesh, dt.shape, dt.placements, p, "all_gather")
                 for dt, p in zip(dts, targets)]
        if all(s is not None for s in steps) and len({(s.mesh_dim, s.dim) for s in steps}) == 1:
            moved = _fused_all_gather(dts, targets, steps)
            if moved is not None:
                return moved
    return [dt.redistribute(placements=p) for dt, p in zip(dts, targets)]


def mode_dtensors(mesh, locals_, placements, shapes, seq, head, ulysses_dims, gather_dims):
    """q, k, v local blocks (this rank's share of global ``shapes`` laid out as ``placements`` on
    ``mesh``, the sequence-split input layout) as DTensors in the mode's layout: the Ulysses
    all-to-all of all three fused into one, then k and v gathered over ``gather_dims`` in one."""
    plan = _mode_plan(mesh, locals_, placements, shapes, seq, head, ulysses_dims, gather_dims)
    if plan.qkv is not None:
        moved = [DTensor.from_local(t, mesh, p, shape=s) if i not in plan.pending else None
                 for i, (t, p, s) in enumerate(zip(locals_, placements, shapes))]
        for i, dt in zip(plan.pending, move_qkv(plan.qkv, [locals_[i] for i in plan.pending])):
            moved[i] = dt
    else:
        moved = [DTensor.from_local(t, mesh, p, shape=s).redistribute(placements=staged)
                 for t, p, s, staged in zip(locals_, placements, shapes, plan.staged)]
    if not gather_dims:
        return moved
    return moved[:1] + _gather_kv(moved[1:], plan.targets[1:])


def to_mode(dts, seq, head, ulysses_dims, gather_dims, fuse=True):
    """q, k, v DTensors (in their sequence-split input layout) in the mode's layout: the Ulysses
    all-to-all of all three fused into one, then k and v gathered over ``gather_dims`` in one
    (``fuse=False``: one collective per tensor, so only one tensor's staging buffers are alive at a
    time)."""
    mesh, ndim = dts[0].device_mesh, dts[0].ndim
    if not fuse:
        targets = [mode_placements(dt.placements, mesh, ndim, seq, head, ulysses_dims, gather_dims)
                   for dt in dts]
        targets = [targets[0][0]] + [kv for _, kv in targets[1:]]
        return [dt.redistribute(placements=p) for dt, p in zip(dts, targets)]
    return mode_dtensors(mesh, [dt.to_local() for dt in dts], [dt.placements for dt in dts],
                         [dt.shape for dt in dts], seq, head, ulysses_dims, gather_dims)
