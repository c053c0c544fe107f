"""``local_map`` and ``implicit_replication``: PyTorch's experimental DTensor helpers.

``local_map(func, out_placements, in_placements, in_grad_placements, device_mesh)`` runs a function
written for plain tensors on each rank's shards: DTensor arguments become their local shards (in
the layout ``in_placements`` asks for), the function runs, and its tensor outputs become DTensors
with ``out_placements``. Differentiable both ways (to_local / from_local).

``implicit_replication()`` lets plain tensors mix with DTensors as Replicate. Here that is always
so (a plain tensor beside DTensors is replicated; a 0-dim one is a scalar), so the context manager
only exists for PyTorch code that wraps such mixing in it.
"""
from typing import Any, Callable, Iterator, Optional, Sequence, Union
import contextlib
import functools

from hyper_parallel.core.dtensor.device_mesh import DeviceMesh
from hyper_parallel.core.dtensor.dtensor import DTensor
from hyper_parallel.core.dtensor.placement_types import Placement, normalize_placements
from hyper_parallel.core.dtensor.dispatch.tree import tree_flatten, tree_unflatten
from hyper_parallel.platform import get_platform


@contextlib.contextmanager
def implicit_replication() -> Iterator[None]:
    """Plain tensors mixed with DTensors count as Replicate on the DTensors' mesh (always the case
    in hyper_parallel; kept for code written for PyTorch)."""
    yield


def local_map(func: Optional[Callable[..., Any]] = None,
              out_placements: Optional[Sequence[Union[Placement, Sequence[Placement], None]]] = None,
              in_placements: Optional[Sequence[Optional[Sequence[Placement]]]] = None,
              in_grad_placements: Optional[Sequence[Optional[Sequence[Placement]]]] = None,
              device_mesh: Optional[DeviceMesh] = None, *,
              redistribute_inputs: bool = False) -> Callable[..., Any]:
    """``func`` applied to local shards, with PyTorch's signature (used directly or as a decorator).

    ``in_placements``: per positional argument, the placements a DTensor argument must have (None:
    any / not a tensor); a DTensor in another layout is redistributed with
    ``redistribute_inputs=True``, else a ValueError. ``in_grad_placements``: per argument, the
    layout of its local gradient (default: its placements). ``out_placements``: the placements of
    the output (a list), or one entry per output (None for a non-tensor output). With no DTensor
    argument the function runs as it is and its outputs stay plain tensors."""
    if func is None:
        return functools.partial(local_map, out_placements=out_placements, in_placements=in_placements,
                                 in_grad_placements=in_grad_placements, device_mesh=device_mesh,
                                 redistribute_inputs=redistribute_inputs)

    @functools.wraps(func)
    def wrapped(*args, **kwargs):
        mesh = device_mesh or next((a.device_mesh for a in args if isinstance(a, DTensor)), None)
        if mesh is None or not any(isinstance(a, DTensor) for a in args):
            return func(*args, **kwargs)
        _check_lengths(func, args, in_placements, in_grad_placements)
        locals_ = [_to_local(func, i, a, mesh, in_placements, in_grad_placements, redistribute_inputs)
                   for i, a in enumerate(args)]
        return _wrap_outputs(func, func(*locals_, **kwargs), mesh, out_placements)
    return wrapped


def _check_lengths(func, args, in_placements, in_grad_placements):
    for what, given in (("in_placements", in_placements), ("in_grad_placements", in_grad_placements)):
        if given is not None and len(given) != len(args):
            raise ValueError(f"local_map({_name(func)}): {what} has {len(given)} entries for {len(args)} "
                             f"positional arguments; give one per argument (None for a non-tensor)")


def _name(func):
    return getattr(func, "__name__", repr(func))


def _to_local(func, i, arg, mesh, in_placements, in_grad_placements, redistribute):
    if not isinstance(arg, DTensor):
        return arg
    if arg.device_mesh != mesh:
        raise ValueError(f"local_map({_name(func)}): argument {i} is on {arg.device_mesh}, not on {mesh}; "
                         f"redistribute it onto one mesh first")
    want = None if in_placements is None else in_placements[i]
    if want is not None:
        want = normalize_placements(want, arg.ndim, mesh.ndim)
        if want != arg.placements:
            if not redistribute:
                raise ValueError(f"local_map({_name(func)}): argument {i} has placements {arg.placements} "
                                 "but "
                                 f"in_placements asks for {want}; pass redistribute_inputs=True or "
                                 f"redistribute it first")
            arg = arg.redistribute(mesh, want)
    grad = None if in_grad_placements is None else in_grad_placements[i]
    return arg.to_local(grad_placements=grad)


def _wrap_outputs(func, result, mesh, out_placements):
    if out_placements is None:
        return result
    platform = get_platform()
    single = not isinstance(result, (tuple, list))
    leaves, structure = tree_flatten(result)
    if single or (out_placements and not isinstance(out_placements[0], (list, tuple, type(None)))):
        per_output = [out_placements]  # one output: out_placements is its placements list
    else:
        per_output = list(out_placements)
    if len(per_output) != len(leaves):
        raise ValueError(f"local_map({_name(func)}): out_placements {out_placements} describe "
                         f"{len(per_output)} output(s) but the function returned {len(leaves)}")
    out = [DTensor.from_local(leaf, mesh, placements) if placements is not None and platform.is_tensor(leaf)
           else leaf for leaf, placements in zip(leaves, per_output)]
    return tree_unflatten(out, structure)
