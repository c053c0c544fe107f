"""DTensor factories: ``zeros / ones / empty / full / rand / randn`` with a mesh and placements.

Each rank allocates only its own piece, except the random ones: they draw the whole tensor from
the framework's generator and keep this rank's piece, so the result equals the single-device
draw under the same seed (as the random ops on DTensors do).
"""
from typing import Optional, Sequence, Union
from hyper_parallel.core.dtensor.device_mesh import DeviceMesh
from hyper_parallel.core.dtensor.dtensor import DTensor, as_layout
from hyper_parallel.core.dtensor.mesh_registry import resolve_mesh
from hyper_parallel.core.dtensor.placement_types import Placement, Replicate, normalize_placements
from hyper_parallel.core.dtensor.spec import DTensorSpec
from hyper_parallel.core.typing import DType
from hyper_parallel.platform import get_platform

__all__ = ["zeros", "ones", "empty", "full", "rand", "randn", "resolve_mesh"]


def _size(size, who):
    if len(size) == 1 and hasattr(size[0], "__len__"):  # zeros((2, 3)) as well as zeros(2, 3)
        size = tuple(size[0])
    if not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in size):
        raise ValueError(f"{who}: size must be non-negative ints, got {size!r}")
    return tuple(int(s) for s in size)


def _create(kind, size, device_mesh, placements, dtype, requires_grad, fill_value=None):
    who = f"hyper_parallel.{kind}"
    shape = _size(size, who)
    mesh = resolve_mesh(device_mesh, who)
    placements = normalize_placements(placements or [Replicate()] * mesh.ndim, len(shape), mesh.ndim)
    spec = DTensorSpec(mesh, placements, shape)
    platform = get_platform()
    device = mesh.device_type
    if mesh.get_coordinate() is None:  # a rank outside the mesh holds an empty piece
        local = platform.create_tensor("empty", (0,), dtype, device)
    elif kind in ("rand", "randn") or any(p.is_partial() for p in placements):
        # the whole tensor, then this rank's piece: the single-device values (and, for Partial,
        # the value on one rank with zeros elsewhere, which sums to it)
        whole = platform.create_tensor(kind, shape, dtype, device, fill_value)
        replicated = DTensor._make(whole, spec.with_placements((Replicate(),) * mesh.ndim))
        local = as_layout(replicated, spec)._local_tensor
    else:
        local = platform.create_tensor(kind, spec.local_shape, dtype, device, fill_value)
    out = DTensor._make(local, spec)
    return out.requires_grad_(True) if requires_grad else out


def zeros(*size: Union[int, Sequence[int]], device_mesh: Optional[DeviceMesh] = None,
          placements: Optional[Sequence[Placement]] = None, dtype: Optional[DType] = None,
          requires_grad: bool = False) -> DTensor:
    """A DTensor of zeros of global ``size`` laid out as ``placements`` (default: replicated)."""
    return _create("zeros", size, device_mesh, placements, dtype, requires_grad)


def ones(*size: Union[int, Sequence[int]], device_mesh: Optional[DeviceMesh] = None,
         placements: Optional[Sequence[Placement]] = None, dtype: Optional[DType] = None,
         requires_grad: bool = False) -> DTensor:
    """A DTensor of ones of global ``size``."""
    return _create("ones", size, device_mesh, placements, dtype, requires_grad)


def empty(*size: Union[int, Sequence[int]], device_mesh: Optional[DeviceMesh] = None,
          placements: Optional[Sequence[Placement]] = None, dtype: Optional[DType] = None,
          requires_grad: bool = False) -> DTensor:
    """An uninitialised DTensor of global ``size``."""
    return _create("empty", size, device_mesh, placements, dtype, requires_grad)


def full(size: Sequence[int], fill_value: float, *, device_mesh: Optional[DeviceMesh] = None,
         placements: Optional[Sequence[Placement]] = None, dtype: Optional[DType] = None,
         requires_grad: bool = False) -> DTensor:
    """A DTensor of global ``size`` filled with ``fill_value``."""
    return _create("full", (size,), device_mesh, placements, dtype, requires_grad, fill_value)


def rand(*size: Union[int, Sequence[int]], device_mesh: Optional[DeviceMesh] = None,
         placements: Optional[Sequence[Placement]] = None, dtype: Optional[DType] = None,
         requires_grad: bool = False) -> DTensor:
    """Uniform [0, 1) values, equal to the single-device ``rand(size)`` under the same seed."""
    return _create("rand", size, device_mesh, placements, dtype, requires_grad)


def randn(*size: Union[int, Sequence[int]], device_mesh: Optional[DeviceMesh] = None,
          placements: Optional[Sequence[Placement]] = None, dtype: Optional[DType] = None,
          requires_grad: bool = False) -> DTensor:
    """Standard normal values, equal to the single-device ``randn(size)`` under the same seed."""
    return _create("randn", size, device_mesh, placements, dtype, requires_grad)
