"""The mesh fully_shard shards over: which dim shards, which replicates (HSDP), and the layout a
parameter takes on it (a tensor-parallel DTensor joins its TP mesh: the (dp_shard, tp) mesh)."""
from typing import Any
from hyper_parallel.core.dtensor.device_mesh import DeviceMesh
from hyper_parallel.core.dtensor.placement_types import Replicate, Shard, StridedShard
from hyper_parallel.core.dtensor.spec import DTensorSpec

HSDP_NAMES = ("dp_replicate", "dp_shard")


class FSDPMeshInfo:
    """``shard_group`` (size ``shard_size``, this rank at ``shard_rank``) all-gathers parameters and
    reduce-scatters gradients; ``replicate_group`` (HSDP only) all-reduces the reduced shards."""

    def __init__(self, mesh: Any) -> None:
        check_mesh(mesh)
        self.mesh = mesh
        self.shard_dim = mesh.ndim - 1
        self.shard_group = mesh.get_group(self.shard_dim)
        self.shard_size = mesh.size(self.shard_dim)
        self.shard_rank = mesh.get_local_rank(self.shard_dim)
        self.replicate_group = mesh.get_group(0) if mesh.ndim == 2 else None
        self.replicate_size = mesh.size(0) if mesh.ndim == 2 else 1

    def sharded_spec(self, shape: Any, tp_spec: Any, name: str) -> Any:
        """The spec of a parameter's shard: dim 0 split over the shard dim (replicated over
        dp_replicate); a TP DTensor keeps its TP placement on the concatenated mesh, and when TP
        also splits dim 0 the dp split applies to the TP shard (StridedShard), so that gathering
        over dp gives back exactly the TP shard the module computes with."""
        dp = [Replicate()] * (self.mesh.ndim - 1) + [Shard(0)]
        if tp_spec is None:
            return DTensorSpec(self.mesh, tuple(dp), tuple(shape))
        tp_mesh = tp_spec.mesh
        if tp_mesh.ndim != 1:
            raise ValueError(f"fully_shard: parameter {name} is a DTensor on the {tp_mesh.ndim}-D mesh "
                             f"{tp_mesh.mesh_dim_names}; only 1-D tensor-parallel DTensor parameters compose "
                             f"with fully_shard (parallelize_module on mesh['tp'])")
        try:
            joint = DeviceMesh.concatenate([self.mesh, tp_mesh])
        except ValueError as exc:
            raise ValueError(f"fully_shard: parameter {name} lives on {tp_mesh} and cannot join the "
                             f"fully_shard mesh {self.mesh} ({exc}); slice both from one root mesh, e.g. "
                             f"mesh['dp_shard'] and mesh['tp'] of init_device_mesh(..., "
                             f"mesh_dim_names=('dp_shard', 'tp'))") from None
        tp_placement = tp_spec.placements[0]
        if tp_placement.is_partial():
            raise ValueError(f"fully_shard: parameter {name} is Partial on its TP mesh; parameters must be "
                             f"Shard or Replicate")
        names = joint.mesh_dim_names
        tp_index = names.index(tp_mesh.mesh_dim_names[0])
        dp_index = names.index(self.mesh.mesh_dim_names[-1])
        if tp_placement.is_shard(0) and tp_index > dp_index:
            dp[-1] = StridedShard(0, tp_mesh.size())
        placements: list[Any] = [None] * joint.ndim
        for d, name_ in enumerate(self.mesh.mesh_dim_names):
            placements[names.index(name_)] = dp[d]
        placements[tp_index] = tp_placement
        return DTensorSpec(joint, tuple(placements), tuple(shape))


def check_mesh(mesh: Any) -> None:
    if not isinstance(mesh, DeviceMesh):
        raise ValueError(f"fully_shard(mesh={mesh!r}): pass a hyper_parallel DeviceMesh (init_device_mesh)")
    names = mesh.mesh_dim_names
    if mesh.ndim == 2 and tuple(names or ()) == HSDP_NAMES:
        return
    if mesh.ndim != 1:
        raise ValueError(f"fully_shard: a {mesh.ndim}-D mesh with dims {names} is neither 1-D (ZeRO-3) nor "
                         f"2-D named {HSDP_NAMES} (HSDP); slice it (mesh['dp']), flatten it "
                         f"(mesh['dp', 'cp'].flatten('dp_cp')) or name its dims {HSDP_NAMES}")
