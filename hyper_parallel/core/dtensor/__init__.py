"""Distributed tensors: DeviceMesh, placements, DTensor, redistribution and op dispatch."""
from hyper_parallel.core.dtensor.device_mesh import DeviceMesh, current_mesh, init_device_mesh
from hyper_parallel.core.dtensor.placement_types import Partial, Placement, Replicate, Shard, StridedShard
from hyper_parallel.core.dtensor.dtensor import DTensor, ENTRY_POINTS
from hyper_parallel.core.dtensor.api import distribute_module, distribute_tensor
from hyper_parallel.core.dtensor.local_map import implicit_replication, local_map
from hyper_parallel.core.dtensor.ops.user_sharding import register_sharding
from hyper_parallel.core.dtensor import checkpoint as _checkpoint
from hyper_parallel.core.dtensor.aten.aten_dispatch import dispatch_aten as _dispatch_aten
from hyper_parallel.core.dtensor.aten.foreach import run_fused as _run_fused
from hyper_parallel.core.dtensor.dispatch.fallback import run_replicated as _run_replicated
from hyper_parallel.core.dtensor.dispatch.fast_path import dispatch as _dispatch
from hyper_parallel.core.dtensor.redistribute_cast import redistribute_cast as _redistribute_cast

# DTensor's methods delegate to these (dtensor.py ``EntryPoints``: those modules import DTensor, so
# it cannot import them); the sharding rules register themselves when ``ops`` is imported (by
# dispatch/dispatcher.py and ops/user_sharding.py, which look them up)
ENTRY_POINTS.bind(function=_dispatch, replicated=_run_replicated, aten=_dispatch_aten, fused=_run_fused,
                  describe=_checkpoint.describe, checkpoint_box=_checkpoint.checkpoint_box,
                  rebuild=_checkpoint.rebuild, redistribute_cast=_redistribute_cast)

__all__ = ["DeviceMesh", "init_device_mesh", "current_mesh", "Placement", "Shard", "StridedShard",
           "Replicate", "Partial", "DTensor", "distribute_tensor", "distribute_module",
           "local_map", "register_sharding", "implicit_replication"]
