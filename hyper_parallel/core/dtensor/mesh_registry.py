"""The meshes this process knows: the one a call means (``resolve_mesh``: given, or the ``with mesh:``
mesh), and the meshes DTensors were made or saved on, found again by their description when a
pickled DTensor is loaded (checkpoint.py)."""
from typing import Any
import weakref

from hyper_parallel.core.dtensor.device_mesh import DeviceMesh, current_mesh
from hyper_parallel.platform import get_platform

# meshes this process has made DTensors on, by identity (mesh shape, dim names, ranks)
_MESHES: Any = weakref.WeakValueDictionary()


def remember_mesh(mesh: Any) -> Any:
    _MESHES[mesh.to_hash()] = mesh
    return mesh


def resolve_mesh(device_mesh: Any, who: Any) -> Any:
    """``device_mesh``, or the mesh of the innermost ``with mesh:`` block."""
    if device_mesh is not None:
        return device_mesh
    mesh = current_mesh()
    if mesh is None:
        raise ValueError(f"{who} needs a device_mesh: pass device_mesh=..., or call it inside `with mesh:`")
    return mesh


def _candidates():
    yield from list(_MESHES.values())
    mesh = current_mesh()
    if mesh is not None:
        yield mesh
        root = mesh.root_mesh or mesh
        names = root.mesh_dim_names or ()
        yield root
        for name in names:
            yield root[name]


def find_mesh(mesh_desc: Any) -> Any:
    """The mesh of this process described by ``mesh_desc`` (see module docstring)."""
    device_type, mesh_shape, ranks, names = mesh_desc
    key = (tuple(mesh_shape), None if names is None else tuple(names), tuple(ranks))
    for mesh in _candidates():
        if mesh.to_hash() == key:
            return remember_mesh(mesh)
    platform = get_platform()
    if sorted(ranks) == list(range(platform.get_world_size())):
        import numpy as np
        grid = np.asarray(ranks, dtype=np.int64).reshape(mesh_shape)
        return remember_mesh(DeviceMesh(device_type, grid, mesh_dim_names=names))
    raise ValueError(f"loading a DTensor saved on the mesh {list(ranks)} of shape {tuple(mesh_shape)} "
                     f"(dims {names}), which this process does not have: create that mesh and load inside "
                     f"`with mesh:` (a sub-mesh is found by its dim name), or use "
                     f"torch.distributed.checkpoint to load onto another mesh")
