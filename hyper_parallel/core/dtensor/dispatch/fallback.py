"""Ops without a sharding rule: replicate, run, return Replicate — and say so, once per op."""
from typing import Any, Iterator
import contextlib
import os
import warnings
from hyper_parallel.core.dtensor.dispatch.tree import tree_flatten, tree_unflatten
from hyper_parallel.core.dtensor.dtensor import DTensor
from hyper_parallel.core.dtensor.placement_types import Replicate
from hyper_parallel.platform import get_platform

_warned: set[Any] = set()
_recorders: list[Any] = []


@contextlib.contextmanager
def recording_fallbacks() -> Iterator[Any]:
    """Collect the names of the ops that take the fallback inside the block (the op sweep's table
    and tests use it to tell a rule from a fallback)."""
    names: set[Any] = set()
    _recorders.append(names)
    try:
        yield names
    finally:
        _recorders.remove(names)


def strict_dispatch() -> bool:
    return os.environ.get("HP_STRICT_DISPATCH", "").strip().lower() in ("1", "true", "yes", "on")


def report_missing_rule(op_name: str) -> None:
    for names in _recorders:
        names.add(op_name)
    if strict_dispatch():
        raise NotImplementedError(
            f"hyper_parallel has no sharding rule for {op_name} on DTensor inputs (HP_STRICT_DISPATCH=1). "
            f"Add one with hyper_parallel.core.dtensor.ops.register_rule, or unset HP_STRICT_DISPATCH to "
            f"run it replicated.")
    if op_name not in _warned:
        _warned.add(op_name)
        warnings.warn(f"hyper_parallel: no sharding rule for {op_name}; its DTensor inputs are "
                      f"replicated (all-gathered) and it runs on full tensors. Register a rule to "
                      f"avoid the extra communication.", stacklevel=3)


def run_replicated(name: str, op: Any, args: Any, kwargs: Any) -> Any:
    """No rule (a framework whose ops reach a DTensor at the function level only: MindSpore): every
    DTensor input is gathered (differentiably), the op runs on the full values, and tensor outputs
    become Replicate DTensors."""
    leaves, structure = tree_flatten((args, kwargs))
    dtensors = [x for x in leaves if isinstance(x, DTensor)]
    mesh = dtensors[0].device_mesh
    for d in dtensors[1:]:
        if d.device_mesh != mesh:
            raise ValueError(f"{name}: DTensor inputs live on different meshes ({mesh} and {d.device_mesh})")
    report_missing_rule(name)
    full = [x.full_tensor() if isinstance(x, DTensor) else x for x in leaves]
    full_args, full_kwargs = tree_unflatten(full, structure)
    out_leaves, out_structure = tree_flatten(op(*full_args, **full_kwargs))
    replicate = [Replicate()] * mesh.ndim
    is_tensor = get_platform().is_tensor
    wrapped = [DTensor.from_local(o, mesh, replicate) if is_tensor(o) else o for o in out_leaves]
    return tree_unflatten(wrapped, out_structure)
