"""q, k and v moved to a mode's layout in as few collectives as the layout allows.

Moved one by one, Ulysses runs three all-to-alls (q, k, v) and all-gather KV two all-gathers
(k, v), in forward and again in backward. Where every tensor's move is the same single even
collective on the same mesh dim (the redistribution planner says so), the tensors travel in one:

* all-to-all (sequence -> heads): each tensor's head dim is cut into the n blocks the ranks will
  hold, and block j of q, k and v are laid side by side, so the one all-to-all hands rank j
  [q block j | k block j | v block j] from every rank; it splits them again by head counts.
  q and k/v may differ in head count (GQA) but must agree on every other dim and the dtype.
  q, k, v of one shape are instead stacked on a new leading dim, so each result is a contiguous
  slice (kernels then copy nothing).
* all-gather (k, v on the gather dims): k and v stacked on a new leading dim, one all-gather.

Both are differentiable through the platform's collectives, so backward is one all-to-all (one
reduce-scatter) of the stacked gradients as well. Anything else (uneven blocks, a plan of several
steps, mismatched dims or dtypes) takes the per-tensor redistribution, which is always correct.
"""
from hyper_parallel.core.context_parallel.layouts import mode_placements
from hyper_parallel.core.dtensor.dtensor import DTensor
from hyper_parallel.core.dtensor.placement_types import Partial
from hyper_parallel.core.dtensor.redistribute import plan_redistribute
from hyper_parallel.platform import get_platform


def _single_step(dt, placements, kind):
    """The one even ``kind`` step that moves ``dt`` to ``placements``, or None."""
    steps = plan_redistribute(dt.device_mesh, dt.shape, dt.placements, placements)
    if len(steps) != 1 or steps[0].kind != kind:
        return None
    step = steps[0]
    if len(set(step.sizes)) > 1 or len(set(step.new_sizes)) > 1:
        return None
    return step


def _slice(t, dim, start, length):
    # basic slicing, differentiable on every platform (MindSpore's narrow differs at the edges)
    return t[(slice(None),) * dim + (slice(start, start + length),)]


def _fusable(dts, steps):
    """One collective can carry them: one step each, on one mesh dim between the same tensor dims,
    and local blocks that differ only in head count (dim ``new_dim`` of an all-to-all, or the
    tensor dim ``head`` the caller stacks on)."""
    if any(s is None for s in steps) or len({(s.mesh_dim, s.dim, s.new_dim) for s in steps}) != 1:
        return False
    locals_ = [dt.to_local() for dt in dts]
    if len({t.dtype for t in locals_}) != 1 or len({t.ndim for t in locals_}) != 1:
        return False
    return True


def _same_except(locals_, dim):
    shapes = [list(t.shape) for t in locals_]
    for s in shapes:
        s[dim] = 0
    return all(s == shapes[0] for s in shapes)


def _stacked_all_to_all(dts, locals_, targets, step, head):
    """Equal shapes: stacked on a new leading dim, one all-to-all, each result a contiguous slice."""
    platform = get_platform()
    mesh = dts[0].device_mesh
    stacked = platform.cat([t.unsqueeze(0) for t in locals_], 0)
    moved = platform.differentiable_all_to_all(stacked, mesh.get_group(step.mesh_dim), head + 1, step.dim + 1)
    return [DTensor.from_local(moved[i], mesh, placements, shape=dt.shape)
            for i, (dt, placements) in enumerate(zip(dts, targets))]


def _fused_all_to_all(dts, targets, steps, head):
    """One all-to-all moving every tensor of ``dts`` sequence -> heads (see the module docstring)."""
    platform = get_platform()
    step = steps[0]
    mesh = dts[0].device_mesh
    n = mesh.mesh_shape[step.mesh_dim]
    locals_ = [dt.to_local() for dt in dts]
    if step.new_dim != head or not _same_except(locals_, head) or any(t.shape[head] % n for t in locals_):
        return None
    if len({tuple(t.shape) for t in locals_}) == 1:
        return _stacked_all_to_all(dts, locals_, targets, step, head)
    blocks = []
    for t in locals_:
        shape = list(t.shape)
        blocks.append(t.reshape(tuple(shape[:head] + [n, shape[head] // n] + shape[head + 1:])))
    stacked = platform.cat(blocks, head + 1)
    shape = list(stacked.shape)
    stacked = stacked.reshape(tuple(shape[:head] + [shape[head] * shape[head + 1]] + shape[head + 2:]))
    moved = platform.differentiable_all_to_all(stacked, mesh.get_group(step.mesh_dim), head, step.dim)
    out, start = [], 0
    for dt, t, placements in zip(dts, locals_, targets):
        width = t.shape[head] // n
        out.append(DTensor.from_local(_slice(moved, head, start, width), mesh, placements, shape=dt.shape))
        start += width
    return out


def _fused_all_gather(dts, targets, steps, head):
    """One all-gather of k and v stacked on a new leading dim (each result a contiguous slice)."""
    platform = get_platform()
    step = steps[0]
    mesh = dts[0].device_mesh
    locals_ = [dt.to_local() for dt in dts]
    if len({tuple(t.shape) for t in locals_}) != 1:
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


def _move(dts, targets, kind, head, fuse):
    """``dts`` moved to ``targets``: by one fused ``kind`` collective where possible."""
    pending = [i for i, (dt, p) in enumerate(zip(dts, targets)) if tuple(dt.placements) != tuple(p)]
    if len(pending) > 1:
        group = [dts[i] for i in pending]
        steps = [_single_step(dts[i], targets[i], kind) for i in pending]
        if _fusable(group, steps):
            moved = fuse(group, [targets[i] for i in pending], steps, head)
            if moved is not None:
                dts = list(dts)
                for i, dt in zip(pending, moved):
                    dts[i] = dt
                return dts
    return [dt.redistribute(placements=p) for dt, p in zip(dts, targets)]


def to_mode(dts, seq, head, ulysses_dims, gather_dims, fuse=True):
    """q, k, v DTensors (in their sequence-split input layout) in the mode's layout: the Ulysses
    all-to-all of all three fused into one, then k and v gathered over ``gather_dims`` in one
    (``fuse=False``: one collective per tensor, so only one tensor's staging buffers are alive at a
    time)."""
    mesh, ndim = dts[0].device_mesh, dts[0].ndim
    targets = [mode_placements(dt.placements, mesh, ndim, seq, head, ulysses_dims, gather_dims) for dt in dts]
    targets = [targets[0][0]] + [kv for _, kv in targets[1:]]
    if not fuse:
        return [dt.redistribute(placements=p) for dt, p in zip(dts, targets)]
    staged = [mode_placements(dt.placements, mesh, ndim, seq, head, ulysses_dims, [])[0] for dt in dts]
    moved = list(dts)
    if ulysses_dims:
        moved = _move(moved, staged, "all_to_all", head, _fused_all_to_all)
    if not gather_dims:
        return moved
    return moved[:1] + _move(moved[1:], targets[1:], "all_gather", head, _fused_all_gather)
