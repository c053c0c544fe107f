"""DTensorSpec: the global metadata of a DTensor (mesh, placements, global shape)."""
from typing import Any
from dataclasses import dataclass

from hyper_parallel.core.dtensor.layout import local_box


@dataclass(frozen=True)
class DTensorSpec:
    mesh: Any
    placements: tuple
    shape: tuple

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def with_placements(self, placements: Any) -> Any:
        return DTensorSpec(self.mesh, tuple(placements), self.shape)

    def local_box(self) -> Any:
        return local_box(self.shape, self.placements, self.mesh.mesh_shape, self.mesh.get_coordinate())

    @property
    def local_shape(self) -> Any:
        return tuple(size for _, size in self.local_box())

    def key(self) -> Any:
        return (self.mesh.to_hash(), self.placements, self.shape)
