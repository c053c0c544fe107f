"""What the q/k/v moves share: the one even collective step a move must be, and ``Block``, a tensor
on its way (no DTensor built until a chunk reaches the attention)."""
from typing import Any, Optional
from dataclasses import dataclass

from hyper_parallel.core.dtensor.dtensor import DTensor
from hyper_parallel.core.dtensor.redistribute import plan_redistribute


def single_step(mesh: Any, shape: Any, src: Any, dst: Any, kind: Any) -> Any:
    """The one even ``kind`` step that moves a ``shape`` tensor from ``src`` to ``dst``, or None."""
    steps = plan_redistribute(mesh, shape, src, dst)
    if len(steps) != 1 or steps[0].kind != kind:
        return None
    step = steps[0]
    if len(set(step.sizes)) > 1 or len(set(step.new_sizes)) > 1:
        return None
    return step


def shared_step(mesh: Any, shapes: Any, sources: Any, targets: Any, kind: Any) -> Any:
    """The one step that moves every tensor (global ``shapes``) from ``sources`` to ``targets`` —
    the same collective on the same mesh dim and tensor dims for all — or None."""
    steps = [single_step(mesh, shape, src, dst, kind) for shape, src, dst in zip(shapes, sources, targets)]
    if any(s is None for s in steps) or len({(s.mesh_dim, s.dim, s.new_dim) for s in steps}) != 1:
        return None
    return steps[0]


@dataclass(frozen=True)
class Block:
    """One tensor on the way: this rank's local piece, its placements and global shape, and the
    placements its gradient is taken in (None: the placements)."""
    local: object
    placements: tuple
    shape: tuple
    grads: Optional[tuple] = None

    def dtensor(self, mesh: Any) -> Any:
        return DTensor.from_local(self.local, mesh, self.placements, shape=self.shape,
                                  grad_placements=self.grads)
