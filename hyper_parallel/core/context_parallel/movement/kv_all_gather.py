"""k and v gathered over a mesh dim by one all-gather: the plan, run whole or split in two.

k and v (one shape, one dtype) are stacked on a new leading dim and gathered once; each result is a
slice of what arrives. Their gradients are taken as Partial on the gathered mesh dim: every rank's
queries contribute a share of the gathered K/V's gradient, which the all-gather's adjoint (one
reduce-scatter) sums exactly once. ``run`` moves DTensors now; ``start`` launches through the
platform's split collectives and returns ``finish`` (overlap).
"""
from typing import Any
from hyper_parallel.core.context_parallel.movement.steps import Block, shared_step
from hyper_parallel.core.dtensor.dtensor import DTensor
from hyper_parallel.core.dtensor.placement_types import Partial
from hyper_parallel.platform import get_platform


class KVAllGather:
    """Tensors ``indices`` (k and v) of one shape and dtype, gathered by one all-gather."""

    __slots__ = ("mesh", "indices", "mesh_dim", "dim", "targets")

    def __init__(self, mesh: Any, indices: Any, step: Any, targets: Any) -> None:
        self.mesh, self.indices, self.mesh_dim, self.dim = mesh, tuple(indices), step.mesh_dim, step.dim
        self.targets = [tuple(t) for t in targets]

    @classmethod
    def plan(cls, mesh: Any, shapes: Any, sources: Any, targets: Any, dtypes: Any,
             indices: Any = (1, 2)) -> Any:
        """The gather of the tensors at ``indices`` (global ``shapes``, ``sources`` -> ``targets``,
        ``dtypes``, all indexed like q, k, v), or None where it is not one shared even all-gather of
        tensors of one shape and dtype."""
        pick = lambda seq: [seq[i] for i in indices]  # noqa: E731
        step = shared_step(mesh, pick(shapes), pick(sources), pick(targets), "all_gather")
        if step is None or len({tuple(s) for s in pick(shapes)}) != 1 or len(set(pick(dtypes))) != 1:
            return None
        return cls(mesh, indices, step, pick(targets))

    def _grads(self, placements):
        grads = list(placements)
        grads[self.mesh_dim] = Partial()
        return tuple(grads)

    def _stacked(self, locals_):
        return get_platform().cat([t.unsqueeze(0) for t in locals_], 0)

    def run(self, dts: Any) -> Any:
        """The moved DTensors (for ``dts``, the DTensors at ``indices``), one differentiable all-gather."""
        if len({tuple(dt.to_local().shape) for dt in dts}) != 1:
            return [dt.redistribute(placements=p) for dt, p in zip(dts, self.targets)]
        gathered = get_platform().differentiable_all_gather(
            self._stacked([dt.to_local() for dt in dts]), self.mesh.get_group(self.mesh_dim), self.dim + 1)
        return [DTensor.from_local(gathered[i], self.mesh, p, shape=dt.shape, grad_placements=self._grads(p))
                for i, (dt, p) in enumerate(zip(dts, self.targets))]

    def start(self, blocks: Any, observer: Any = None) -> Any:
        """Launch the gather of ``blocks[i]`` for i in ``indices``; returns ``finish`` -> all blocks."""
        stacked = self._stacked([blocks[i].local for i in self.indices])
        pending = get_platform().start_differentiable_collective(
            "all_gather", stacked, self.mesh.get_group(self.mesh_dim), (self.dim + 1,), observer)

        def finish():
            gathered, out = pending.wait(), list(blocks)
            pieces = [p.reshape(tuple(p.shape[1:])) for p in gathered.chunk(len(self.indices), 0)]
            for piece, i, placements in zip(pieces, self.indices, self.targets):
                out[i] = Block(piece, placements, blocks[i].shape, self._grads(placements))
            return out
        return finish
