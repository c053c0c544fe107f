"""Context-parallel layout moves split into a start and a finish, so compute runs while they travel
(used by overlap.py).

Each move is one even collective on one mesh dim, the same step for every tensor it moves (the
redistribution planner says so; checked before any collective, else the caller runs unsplit):

* ``AllToAll``: q, k, v sequence -> heads in one all-to-all. Each tensor's head dim is cut into the
  n blocks the ranks will hold and block j of every tensor laid side by side (the layout of
  fused_collectives.py), so rank j receives [q block j | k block j | v block j] from every rank.
* ``AllGather``: k and v stacked on a new leading dim, one all-gather.
* ``start_output``: the attention output heads -> sequence, one all-to-all (nothing to move in the
  all-gather KV mode; any other plan runs the ordinary redistribution, unsplit).

Tensors travel as ``Block``s (local tensor, placements, global shape) so that no DTensor is built
until a chunk reaches the attention. ``start`` launches through the platform's split collectives
(``start_differentiable_collective``) and returns ``finish``, which waits and gives the moved blocks.
"""
from dataclasses import dataclass

from hyper_parallel.core.context_parallel.fused_collectives import single_step
from hyper_parallel.core.context_parallel.output import caller_placements, output_seq_dim
from hyper_parallel.core.dtensor.dtensor import DTensor
from hyper_parallel.core.dtensor.placement_types import Partial
from hyper_parallel.platform import get_platform


@dataclass(frozen=True)
class Block:
    """One tensor on the way: this rank's local piece, its placements and global shape, and the
    placements its gradient is taken in (None: the placements)."""
    local: object
    placements: tuple
    shape: tuple
    grads: tuple = None

    def dtensor(self, mesh):
        return DTensor.from_local(self.local, mesh, self.placements, shape=self.shape,
                                  grad_placements=self.grads)


def _steps(mesh, shapes, sources, targets, kind):
    """The shared step moving every tensor (global ``shapes``, ``sources`` placements) to its
    target, or None."""
    steps = [single_step(mesh, shape, src, dst, kind) for shape, src, dst in zip(shapes, sources, targets)]
    if any(s is None for s in steps) or len({(s.mesh_dim, s.dim, s.new_dim) for s in steps}) != 1:
        return None
    return steps[0]


class AllToAll:
    """Blocks ``indices`` of a chunk, equal except in their head count, moved by one all-to-all."""

    def __init__(self, mesh, indices, step, targets):
        self.mesh, self.indices, self.step, self.targets = mesh, tuple(indices), step, list(targets)

    @classmethod
    def plan(cls, mesh, blocks, targets, indices=(0, 1, 2)):
        moved, targets = [blocks[i] for i in indices], [targets[i] for i in indices]
        step = _steps(mesh, [b.shape for b in moved], [b.placements for b in moved], targets, "all_to_all")
        if step is None or len({b.local.dtype for b in moved}) != 1:
            return None
        n = mesh.mesh_shape[step.mesh_dim]
        shapes = [list(b.local.shape) for b in moved]
        if any(s[step.new_dim] % n for s in shapes):
            return None
        for s in shapes:
            s[step.new_dim] = 0
        if any(s != shapes[0] for s in shapes):
            return None
        return cls(mesh, indices, step, targets)

    def start(self, blocks, observer=None):
        platform = get_platform()
        split, concat = self.step.new_dim, self.step.dim
        n = self.mesh.mesh_shape[self.step.mesh_dim]
        locals_ = [blocks[i].local for i in self.indices]
        parts = []
        for t in locals_:
            shape = list(t.shape)
            parts.append(t.reshape(tuple(shape[:split] + [n, shape[split] // n] + shape[split + 1:])))
        packed = platform.cat(parts, split + 1)
        shape = list(packed.shape)
        packed = packed.reshape(tuple(shape[:split] + [shape[split] * shape[split + 1]] + shape[split + 2:]))
        pending = platform.start_differentiable_collective(
            "all_to_all", packed, self.mesh.get_group(self.step.mesh_dim), (split, concat), observer)
        widths = [t.shape[split] // n for t in locals_]

        def finish():
            # one split (its backward is one concatenation, not a zero-filled buffer per piece)
            pieces, out = pending.wait().split(widths, split), list(blocks)
            for i, piece, placements in zip(self.indices, pieces, self.targets):
                out[i] = Block(piece, placements, blocks[i].shape)
            return out
        return finish


class AllGather:
    """Blocks ``indices`` (k and v) of one shape, gathered by one all-gather."""

    def __init__(self, mesh, indices, step, targets):
        self.mesh, self.indices, self.step, self.targets = mesh, tuple(indices), step, list(targets)

    @classmethod
    def plan(cls, mesh, shapes, sources, targets, dtypes, indices=(1, 2)):
        """Global ``shapes``, ``sources`` / ``targets`` placements and ``dtypes`` of every tensor."""
        pick = lambda seq: [seq[i] for i in indices]  # noqa: E731
        step = _steps(mesh, pick(shapes), pick(sources), pick(targets), "all_gather")
        if step is None or len({tuple(s) for s in pick(shapes)}) != 1 or len(set(pick(dtypes))) != 1:
            return None
        return cls(mesh, indices, step, pick(targets))

    def start(self, blocks, observer=None):
        platform = get_platform()
        stacked = platform.cat([blocks[i].local.unsqueeze(0) for i in self.indices], 0)
        pending = platform.start_differentiable_collective(
            "all_gather", stacked, self.mesh.get_group(self.step.mesh_dim), (self.step.dim + 1,), observer)

        def finish():
            gathered, out = pending.wait(), list(blocks)
            pieces = [p.reshape(tuple(p.shape[1:])) for p in gathered.chunk(len(self.indices), 0)]
            for piece, i, placements in zip(pieces, self.indices, self.targets):
                # each rank's queries give a share of the gathered K/V's gradient: Partial on the
                # gathered mesh dim, which the all-gather's adjoint (a reduce-scatter) sums once
                grads = list(placements)
                grads[self.step.mesh_dim] = Partial()
                out[i] = Block(piece, placements, blocks[i].shape, tuple(grads))
            return out
        return finish


def start_output(out, inputs, ulysses_dims, observer=None):
    """Start moving the attention output ``out`` (a DTensor on the working mesh) to the caller's
    sequence split: (finish -> this rank's local block, the output's seq dim, its placements)."""
    seq = output_seq_dim(out, inputs, ulysses_dims)
    target = caller_placements(tuple(out.placements), inputs.mesh, out.ndim, seq, inputs.cp_dims)
    if tuple(out.placements) == tuple(target):
        local = out.to_local()
        return (lambda: local), seq, target
    step = single_step(out.device_mesh, out.shape, out.placements, target, "all_to_all")
    if step is None:
        local = out.redistribute(placements=target).to_local()
        return (lambda: local), seq, target
    group = inputs.mesh.get_group(step.mesh_dim)
    pending = get_platform().start_differentiable_collective(
        "all_to_all", out.to_local(), group, (step.new_dim, step.dim), observer)
    return pending.wait, seq, target
