"""DTensorSpec: the global metadata of a DTensor (mesh, placements, global shape)."""
from dataclasses import dataclass

from hyper_parallel.core.dtensor.layout import local_box


@dataclass(frozen=True)
class DTensorSpec:
    mesh: object
    placements: tuple
    shape: tuple

    @property
    def ndim(self):
        return len(self.shape)

    def with_placements(self, placements):
        return DTensorSpec(self.mesh, tuple(placements), self.shape)

    def local_box(self):
        return local_box(self.shape, self.placements, self.mesh.mesh_shape, self.mesh.get_coordinate())

    @property
    def local_shape(self):
        return tuple(size for _, size in self.local_box())

    def key(self):
        return (self.mesh.to_hash(), self.placements, self.shape)
