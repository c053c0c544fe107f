"""Saving DTensors: the description a pickled DTensor carries, and finding its mesh again.

A pickled DTensor (``torch.save``) is this rank's local piece plus plain-data metadata: the mesh
as (device type, rank grid, dim names), the placements as (class name, arguments) tuples, the
global shape. Nothing but ints, strings and the tensor, so ``torch.load(weights_only=True)``
accepts it. Loading needs a process with the same mesh: one the process already uses (any mesh a
DTensor was made or saved on, the ``with mesh:`` mesh and its named slices), else, for a mesh over
the whole world, a new one (every rank loads, so every rank creates its groups in step).

Checkpoints that change the mesh or placements go through ``torch.distributed.checkpoint``, whose
protocol (each piece's global offsets) the platform's DTensor implements from ``local_box``.
"""
from typing import Any

from hyper_parallel.core.dtensor.dtensor import DTensor
from hyper_parallel.core.dtensor.mesh_registry import find_mesh, remember_mesh
from hyper_parallel.core.dtensor.placement_types import HeadTailShard, Partial, Replicate, Shard, StridedShard
from hyper_parallel.core.dtensor.spec import DTensorSpec
from hyper_parallel.platform import get_platform

__all__ = ["describe", "rebuild", "remember_mesh", "checkpoint_box"]


def _encode_placement(p):
    if isinstance(p, StridedShard):
        return ("StridedShard", p.dim, p.split_factor)
    if isinstance(p, HeadTailShard):
        return ("HeadTailShard", p.dim, p.half)
    if isinstance(p, Shard):
        return ("Shard", p.dim)
    if isinstance(p, Partial):
        return ("Partial", p.reduce_op)
    return ("Replicate",)


_DECODE = {"Shard": Shard, "StridedShard": StridedShard, "HeadTailShard": HeadTailShard,
           "Partial": Partial, "Replicate": Replicate}


def describe(dtensor: Any) -> Any:
    """(local piece, mesh description, placements, global shape, requires_grad): what a pickled
    DTensor holds."""
    spec = dtensor._spec
    mesh = remember_mesh(spec.mesh)
    grid = tuple(int(r) for r in mesh.rank_list)
    mesh_desc = (mesh.device_type, tuple(mesh.mesh_shape), grid, mesh.mesh_dim_names)
    local = dtensor._local_tensor
    local = local.detach() if hasattr(local, "detach") else local
    return (local, mesh_desc, tuple(_encode_placement(p) for p in spec.placements),
            tuple(int(s) for s in spec.shape), bool(dtensor.requires_grad))


def rebuild(local: Any, mesh_desc: Any, placements: Any, shape: Any, requires_grad: Any) -> Any:
    """The DTensor ``describe`` described, on this process's copy of its mesh."""
    if not get_platform().is_initialized():
        raise ValueError(f"loading a DTensor saved on the mesh {list(mesh_desc[2])} (dims {mesh_desc[3]}): "
                         f"this process has no process group yet; start it as one of the ranks that saved "
                         f"it and call init_device_mesh(...) (or torch.distributed.init_process_group) "
                         f"before torch.load (or load a torch.distributed.checkpoint into one process)")
    mesh = find_mesh(mesh_desc)
    spec = DTensorSpec(mesh, tuple(_DECODE[p[0]](*p[1:]) for p in placements), tuple(shape))
    if mesh.get_coordinate() is not None and tuple(local.shape) != spec.local_shape:
        raise ValueError(f"loaded DTensor piece has shape {tuple(local.shape)}, but rank {mesh.get_rank()}'s "
                         f"piece of {tuple(shape)} as {spec.placements} is {spec.local_shape}: load each "
                         f"rank's own file on the rank that saved it")
    out = DTensor._make(local, spec)
    return out.requires_grad_(True) if requires_grad else out


def checkpoint_box(dtensor: Any) -> Any:
    """(offsets, sizes) of this rank's piece in the global tensor for a checkpoint, or None if it
    holds nothing to write (outside the mesh, or an empty piece)."""
    spec = dtensor._spec
    if spec.mesh.get_coordinate() is None:
        return None
    for p in spec.placements:
        if isinstance(p, HeadTailShard) or p.is_partial():
            raise ValueError(f"checkpointing a DTensor laid out as {spec.placements}: its piece is not one "
                             "block of the global tensor; redistribute it to Shard/Replicate placements "
                             "first")
    box = spec.local_box()
    offsets = tuple(int(start) for start, _ in box)
    sizes = tuple(int(size) for _, size in box)
    return offsets, sizes
