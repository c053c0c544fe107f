"""What every tensor-parallel style shares: layout arguments, local <-> DTensor conversion of
inputs and outputs, the 1-D mesh check, and the one helper that turns a module's parameters into
DTensor parameters (``shard_parameters``). ``style.py`` and ``prepare.py`` build the styles on it.
"""
from typing import Any
from hyper_parallel.core.dtensor.api import distribute_tensor
from hyper_parallel.core.dtensor.dtensor import DTensor
from hyper_parallel.core.dtensor.placement_types import Placement, Replicate
from hyper_parallel.platform import get_platform


def _one_layout(value, default, what):
    """A single placement (also accepted: a 1-tuple of one, as PyTorch plans often write)."""
    if value is None:
        return default
    if isinstance(value, (tuple, list)):
        if len(value) != 1:
            raise ValueError(f"{what} takes one placement for the 1-D tensor-parallel mesh, got {value!r}")
        value = value[0]
    if not isinstance(value, Placement):
        raise ValueError(f"{what} must be a placement such as Shard(-1) or Replicate(), got {value!r}")
    return value


def _layout_tuple(value, what):
    """A tuple of placements-or-None, one per input/output (a single placement becomes a 1-tuple)."""
    if value is None:
        return None
    if isinstance(value, Placement):
        return (value,)
    value = tuple(value)
    for v in value:
        if v is not None and not isinstance(v, Placement):
            raise ValueError(f"{what} entries must be placements or None, got {v!r}")
    return value


def _is_tensor(x):
    return get_platform().is_tensor(x)


def to_dtensor(x: Any, mesh: Any, input_layout: Any, desired_layout: Any, feature_size: Any = None) -> Any:
    """``x`` (a local tensor laid out as ``input_layout``, or a DTensor) as a DTensor of
    ``desired_layout`` on ``mesh`` (differentiable).

    A local tensor's global shape is taken as even pieces, except along the last dim when
    ``feature_size`` (the layer's global input features) is given: feature shards are uneven
    ``torch.chunk`` pieces whenever the TP size does not divide the features."""
    if not _is_tensor(x):
        return x
    if isinstance(x, DTensor):
        if x.device_mesh != mesh:
            raise ValueError(f"input DTensor lives on {x.device_mesh}, but the module is parallelized on "
                             f"{mesh}; redistribute it onto the tensor-parallel mesh first")
        dt = x
    else:
        shape = None
        if feature_size is not None and input_layout.is_shard() and x.ndim and \
                input_layout.dim % x.ndim == x.ndim - 1:
            shape = tuple(x.shape[:-1]) + (int(feature_size),)
        dt = DTensor.from_local(x, mesh, [input_layout], run_check=False, shape=shape)
    if desired_layout is not None:
        dt = dt.redistribute(placements=[desired_layout])
    return dt


def from_dtensor(x: Any, mesh: Any, output_layout: Any, use_local_output: Any,
                 input_layout: Any = None) -> Any:
    """Move an output to ``output_layout``; plain tensor outputs are first taken as ``input_layout``
    (the layout the module produced); with ``use_local_output`` return the local shard."""
    if not _is_tensor(x):
        return x
    if not isinstance(x, DTensor):
        if input_layout is None:
            return x
        x = DTensor.from_local(x, mesh, [input_layout], run_check=False)
    if output_layout is not None:
        x = x.redistribute(placements=[output_layout])
    return x.to_local() if use_local_output else x


def check_tp_mesh(device_mesh: Any, who: Any) -> None:
    """A ValueError unless ``device_mesh`` is 1-D, pointing at the slice to pass instead."""
    if device_mesh.ndim == 1:
        return
    names = device_mesh.mesh_dim_names
    if names:
        example = f'mesh["{"tp" if "tp" in names else names[-1]}"]'
    else:
        example = 'mesh["tp"] (create the mesh with mesh_dim_names=(..., "tp") to slice it)'
    raise ValueError(f"{who} needs a 1-D tensor-parallel mesh, got a {device_mesh.ndim}-D mesh "
                     f"{device_mesh}; pass its tensor-parallel slice, e.g. {example}")


def _check_mesh(device_mesh, style):
    check_tp_mesh(device_mesh, type(style).__name__)


def shard_parameters(module: Any, mesh: Any, placements: Any, src_data_rank: Any) -> None:
    """Make ``module``'s own parameters named in ``placements`` (``{name: placement}``) DTensor
    parameters of that placement on ``mesh``; missing names (a Linear without bias) are skipped.
    Feature counts the mesh size does not divide give uneven ``torch.chunk`` shards."""
    platform = get_platform()
    params = dict(platform.named_parameters(module))
    for name, placement in placements.items():
        param = params.get(name)
        if param is None:
            continue
        if isinstance(param, DTensor):
            if tuple(param.placements) == (placement.normalized(param.ndim),) and param.device_mesh == mesh:
                continue  # already in this layout (the style was applied twice)
            raise ValueError(f"parameter {name!r} of {type(module).__name__} is already a DTensor "
                             f"({param.placements} on {param.device_mesh}); a module can be parallelized "
                             "once")
        dt = distribute_tensor(platform.detach(param), mesh, [placement], src_data_rank=src_data_rank)
        platform.set_parameter(module, name, dt.requires_grad_(param.requires_grad))


def replicate_parameters(module: Any, mesh: Any, src_data_rank: Any) -> None:
    """Every parameter of ``module`` and its submodules as a ``Replicate()`` DTensor."""
    platform = get_platform()
    for _, sub in platform.named_modules(module):
        names = [name for name, _ in platform.named_parameters(sub)]
        shard_parameters(sub, mesh, {name: Replicate() for name in names}, src_data_rank)


class ParallelStyle:
    """Base class: ``apply(module, device_mesh)`` parallelizes ``module`` in place and returns it."""

    src_data_rank = 0

    def apply(self, module: Any, device_mesh: Any) -> Any:
        # a subclass written for PyTorch overrides _apply (its contract); ours override apply
        if type(self)._apply is not ParallelStyle._apply:
            return self._apply(module, device_mesh)
        raise NotImplementedError(f"{type(self).__name__} must override apply(module, device_mesh) (or "
                                  f"PyTorch's _apply(module, device_mesh))")

    def _apply(self, module, device_mesh):  # PyTorch's spelling
        return self.apply(module, device_mesh)

    def __repr__(self):
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_")
                           and k != "src_data_rank")
        return f"{type(self).__name__}({fields})"


def map_outputs(output: Any, fn: Any) -> Any:
    if isinstance(output, tuple):
        return tuple(fn(o) for o in output)
    if isinstance(output, list):
        return [fn(o) for o in output]
    return fn(output)
