"""distribute_tensor / distribute_module: turn ordinary tensors and modules into DTensor ones."""
from typing import Any
import numpy as np

from hyper_parallel.core.dtensor.dtensor import DTensor, as_layout
from hyper_parallel.core.dtensor.mesh_registry import remember_mesh, resolve_mesh
from hyper_parallel.core.dtensor.placement_types import Replicate, normalize_placements
from hyper_parallel.core.dtensor.rank_check import (check_replicated_values, check_same_meta, debug_checks,
                                                    is_meta)
from hyper_parallel.core.dtensor.spec import DTensorSpec
from hyper_parallel.platform import get_platform


def _check_src(src_index, mesh):
    if isinstance(src_index, bool) or not isinstance(src_index, int) or not 0 <= src_index < mesh.size():
        raise ValueError(f"src_data_rank={src_index!r} is not a rank of {mesh} (a position "
                         f"0..{mesh.size() - 1} in "
                         f"its rank_list, as in PyTorch); or pass None to use each rank's own copy")


def _broadcast_from(tensor, mesh, src_index):
    """Every rank of ``mesh`` gets the ``tensor`` of the mesh's rank ``src_index`` (its position in
    ``mesh.rank_list``): one broadcast per mesh dim, each from the rank in the line that already
    holds the data."""
    platform = get_platform()
    grid = np.asarray(mesh.rank_list).reshape(mesh.mesh_shape)
    src_coord = [int(c) for c in np.unravel_index(src_index, mesh.mesh_shape)]
    me = list(mesh.get_coordinate())
    for m in range(mesh.ndim):
        coord = me[:m] + [src_coord[m]] + me[m + 1:]
        tensor = platform.broadcast(tensor, int(grid[tuple(coord)]), mesh.get_group(m))
    return tensor


def _already_distributed(dtensor, mesh, placements):
    """A DTensor given to distribute_tensor is returned as it is when it already has the requested
    layout; otherwise PyTorch raises (re-sharding its local piece as if global would be wrong)."""
    if dtensor.device_mesh != mesh:
        raise ValueError(f"distribute_tensor: cannot distribute a DTensor on {dtensor.device_mesh} to "
                         f"another mesh {mesh}; pass the full tensor (dt.full_tensor()) instead")
    if tuple(dtensor.placements) != tuple(placements):
        raise ValueError(f"distribute_tensor: cannot distribute a DTensor with placements "
                         f"{dtensor.placements} to placements {placements}; call "
                         f"dt.redistribute(mesh, {list(placements)}) instead")
    return dtensor


def distribute_tensor(tensor: Any, device_mesh: Any = None, placements: Any = None, *,
                      src_data_rank: int = 0) -> Any:
    """Shard or replicate a global ``tensor`` over ``device_mesh``.

    With ``src_data_rank`` (a rank within the mesh, i.e. a position in ``mesh.rank_list``, as in
    PyTorch) the data really comes from that rank; with None every rank slices its own (identical)
    copy and no data is communicated (with ``HP_DTENSOR_DEBUG=1`` the copies are compared: a
    ValueError on every rank names the largest difference). Either way one small metadata
    all-reduce first checks that every rank passes the same ndim, dtype and shape (a ValueError on
    every rank otherwise), so a mismatch never reaches the data collectives. A meta tensor gives a
    DTensor of meta pieces (no data moves; ``module.to_empty`` then allocates each rank's piece). A
    rank outside ``device_mesh`` gets an empty local piece and communicates nothing, as in PyTorch.
    ``device_mesh`` defaults to the mesh of the innermost ``with mesh:`` block.
    """
    device_mesh = remember_mesh(resolve_mesh(device_mesh, "distribute_tensor"))
    placements = placements or [Replicate()] * device_mesh.ndim
    placements = normalize_placements(placements, tensor.ndim, device_mesh.ndim)
    if isinstance(tensor, DTensor):
        return _already_distributed(tensor, device_mesh, placements)
    if src_data_rank is not None:
        _check_src(src_data_rank, device_mesh)
    requires_grad = getattr(tensor, "requires_grad", False)  # MindSpore tensors have no flag
    data = get_platform().detach(tensor)
    full = DTensorSpec(device_mesh, (Replicate(),) * device_mesh.ndim, tuple(tensor.shape))
    if device_mesh.get_coordinate() is None:
        empty = get_platform().empty((0,), dtype=tensor.dtype, device=getattr(tensor, "device", None))
        return DTensor._make(empty, full.with_placements(placements), requires_grad=requires_grad)
    fix = ("Pass the same global tensor shape and dtype on every rank" +
           ("" if src_data_rank is None else f" (rank {src_data_rank}'s data is sent; the others' tensors "
                                             f"only need its shape and dtype)"))
    check_same_meta(data, device_mesh, "distribute_tensor", fix)
    if src_data_rank is None and debug_checks():
        # every rank slices its own copy: the copies must be one tensor (HP_DTENSOR_DEBUG)
        check_replicated_values(data, device_mesh, full.placements)
    if src_data_rank is not None and not is_meta(data):
        # a meta tensor has no data to send: each rank's meta piece is already right
        data = _broadcast_from(data, device_mesh, src_data_rank)
    local = as_layout(DTensor._make(data, full), full.with_placements(placements))._local_tensor
    out = DTensor._make(local.contiguous(), full.with_placements(placements), requires_grad=requires_grad)
    return out


def _replicate_rest(module, mesh):
    """``module``'s own parameters and buffers that are still plain tensors, as Replicate DTensors
    (PyTorch's distribute_module does the same after ``partition_fn``)."""
    platform = get_platform()
    for pname, param in list(platform.named_parameters(module)):
        if param is not None and not isinstance(param, DTensor):
            platform.set_parameter(module, pname, distribute_tensor(param.data, mesh).requires_grad_(
                param.requires_grad))
    for bname, buf in list(platform.named_buffers(module)):
        if buf is not None and not isinstance(buf, DTensor):
            platform.set_buffer(module, bname, distribute_tensor(buf, mesh))


def distribute_module(module: Any, device_mesh: Any = None, partition_fn: Any = None, input_fn: Any = None,
                      output_fn: Any = None) -> Any:
    """Apply ``partition_fn(name, submodule, mesh)`` to every submodule, then make every parameter
    and buffer it left as a plain tensor a Replicate DTensor; install ``input_fn(module, inputs,
    mesh)`` / ``output_fn(module, outputs, mesh)`` as forward hooks. ``device_mesh`` defaults to the
    ``with mesh:`` mesh."""
    device_mesh = resolve_mesh(device_mesh, "distribute_module")
    platform = get_platform()
    for name, submodule in list(platform.named_modules(module)):
        if partition_fn is not None:
            partition_fn(name, submodule, device_mesh)
        _replicate_rest(submodule, device_mesh)
    if input_fn is not None:
        platform.register_forward_pre_hook(module, lambda mod, inputs: input_fn(mod, inputs, device_mesh))
    if output_fn is not None:
        platform.register_forward_hook(module,
                                       lambda mod, inputs, outputs: output_fn(mod, outputs, device_mesh))
    return module
