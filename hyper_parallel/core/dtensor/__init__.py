"""Distributed tensors: DeviceMesh, placements, DTensor, redistribution and op dispatch."""
from hyper_parallel.core.dtensor.device_mesh import DeviceMesh, current_mesh, init_device_mesh
from hyper_parallel.core.dtensor.placement_types import Partial, Placement, Replicate, Shard, StridedShard
from hyper_parallel.core.dtensor.dtensor import DTensor
from hyper_parallel.core.dtensor.api import distribute_module, distribute_tensor
from hyper_parallel.core.dtensor import ops  # noqa: F401  (registers the sharding rules)
# the modules that attach DTensor's entry points (dtensor.py imports none of them)
from hyper_parallel.core.dtensor.dispatch import fallback, fast_path  # noqa: F401
from hyper_parallel.core.dtensor.aten import aten_dispatch, foreach  # noqa: F401
from hyper_parallel.core.dtensor import checkpoint, redistribute_cast  # noqa: F401
from hyper_parallel.core.dtensor.local_map import implicit_replication, local_map
from hyper_parallel.core.dtensor.ops.user_sharding import register_sharding

__all__ = ["DeviceMesh", "init_device_mesh", "current_mesh", "Placement", "Shard", "StridedShard",
           "Replicate", "Partial", "DTensor", "distribute_tensor", "distribute_module",
           "local_map", "register_sharding", "implicit_replication"]
