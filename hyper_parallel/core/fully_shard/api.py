"""fully_shard(module, mesh): ZeRO-3 / HSDP sharding of a module's parameters (docs/fully_shard.md).

Applied bottom-up: each block, then the root. A call takes the parameters of ``module`` that no
inner fully_shard call took, shards them on dim 0 over ``mesh`` and installs the hooks of
``state.py``. Everything is checked before anything changes, and the checks use only what every
rank has (arguments and the module), so every rank raises the same ValueError before any
collective.
"""
from typing import Optional
from hyper_parallel.core.dtensor.device_mesh import DeviceMesh
from hyper_parallel.core.fully_shard.mesh_info import FSDPMeshInfo
from hyper_parallel.core.fully_shard.mixed_precision import MixedPrecisionPolicy, check_policy
from hyper_parallel.core.fully_shard.param import FSDPParam
from hyper_parallel.core.fully_shard.param_group import FSDPParamGroup
from hyper_parallel.core.fully_shard.state import FSDPState
from hyper_parallel.core.fully_shard import wrap_state
from hyper_parallel.core.fully_shard.tuple_grads import TupleUnit
from hyper_parallel.core.typing import Module
from hyper_parallel.platform import get_platform


def fully_shard(module: Module, mesh: DeviceMesh, *, reshard_after_forward: bool = True,
                mp_policy: Optional[MixedPrecisionPolicy] = None, average: bool = True) -> Module:
    """Shard ``module``'s parameters (those no inner fully_shard took) on dim 0 over ``mesh``: a 1-D
    mesh (ZeRO-3; a flattened dp×cp mesh too) or a 2-D ("dp_replicate", "dp_shard") mesh (HSDP).
    Parameters are gathered before the module's forward and freed after it (kept with
    ``reshard_after_forward=False``), gathered again for backward, and their gradients
    reduce-scattered (averaged, or summed with ``average=False``). Adds ``unshard()``,
    ``reshard()``, ``set_requires_gradient_sync(flag)``, ``set_reshard_after_forward(flag)`` and
    ``set_reshard_after_backward(flag)`` to the module. Returns the module."""
    _check_arguments(module, reshard_after_forward, average)
    policy = check_policy(mp_policy)
    mesh_info = FSDPMeshInfo(mesh)
    owned = _own_parameters(module)
    wrap_state.check_wrappable(module, owned)
    if get_platform().gradients_as_tuple:
        return _tuple_fully_shard(module, owned, mesh_info, policy, average)
    paths = wrap_state.module_paths(module)
    params = [FSDPParam(locations, param, mesh_info, wrap_state.describe(paths, module, locations))
              for param, locations in owned]
    for (param, _), fsdp_param in zip(owned, params):
        wrap_state.record(param, fsdp_param.sharded, fsdp_param.text)
    group = FSDPParamGroup(params, mesh_info, policy, average)
    group.reshard_after_forward = reshard_after_forward
    state = FSDPState(module, group)
    module._hp_fsdp_state = state
    module.unshard = lambda async_op=False: _unshard(state, async_op)
    module.reshard = group.reshard
    module.set_requires_gradient_sync = lambda flag, recurse=True: _set(module, "requires_gradient_sync",
                                                                        flag, recurse)
    module.set_reshard_after_forward = lambda flag, recurse=True: _set(module, "reshard_after_forward",
                                                                       flag, recurse)
    module.set_reshard_after_backward = lambda flag, recurse=True: _set(module, "reshard_after_backward",
                                                                        flag, recurse)
    return module


def _tuple_fully_shard(module, owned, mesh_info, policy, average):
    """MindSpore: the all-gather inside the differentiated graph (tuple_grads.py)."""
    wrap_state.agree_at_wrap(mesh_info.mesh, module, owned)
    unit = TupleUnit(module, owned, mesh_info, policy, average)
    module._hp_fsdp_state = unit
    setters = {f"set_{field}": field for field in ("requires_gradient_sync", "reshard_after_forward",
                                                   "reshard_after_backward")}

    def unshard(async_op=False):
        unit.keep = True
        unit.unshard()
        return _DoneHandle() if async_op else None

    def reshard():
        unit.keep = False
        unit.reshard()

    def setter(field):
        return lambda flag, recurse=True: _set_tuple(module, field, flag, recurse)
    for attr, value in (("unshard", unshard), ("reshard", reshard),
                        *((name, setter(field)) for name, field in setters.items())):
        object.__setattr__(module, attr, value)   # a Cell's __setattr__ would register Cells / params
    return module


class _DoneHandle:
    def wait(self):
        return None


def _set_tuple(module, field, flag, recurse):
    if not isinstance(flag, bool):
        raise ValueError(f"{field}: pass True or False, got {flag!r}")
    platform = get_platform()
    modules = [m for _, m in platform.named_modules(module)] if recurse else [module]
    for m in modules:
        unit = getattr(m, "_hp_fsdp_state", None)
        if unit is not None:
            unit.set_flag(field, flag)


def _check_arguments(module, reshard_after_forward, average):
    platform = get_platform()
    if not isinstance(module, platform.Module):
        raise ValueError(f"fully_shard(module={type(module).__name__}): pass a {platform.Module.__name__}")
    if getattr(module, "_hp_fsdp_state", None) is not None:
        raise ValueError(f"fully_shard was already applied to this {type(module).__name__}; apply it once "
                         f"per module (each block, then the root)")
    if getattr(module, "_hp_grad_reducer", None) is not None:
        raise ValueError(f"this {type(module).__name__} is under data_parallel, which all-reduces whole "
                         f"gradients; use fully_shard instead of data_parallel, not both")
    for value, what in ((reshard_after_forward, "reshard_after_forward"), (average, "average")):
        if not isinstance(value, bool):
            raise ValueError(f"fully_shard({what}={value!r}): pass True or False")


def _own_parameters(module):
    """[(parameter, [(module, name), ...])] of ``module``'s parameters outside inner units, in
    registration order; a parameter held by several modules (tied weights) appears once with every
    place that holds it."""
    platform = get_platform()
    inner = set()
    for _, sub in platform.named_modules(module):
        # an expert-parallel experts module is its own unit (hf_expert_parallel.py) or none at all:
        # its parameters are split over the ep ranks already, which must not gather them
        unit = getattr(sub, "_hp_fsdp_state", None) is not None
        if sub is not module and (unit or getattr(sub, "_hp_expert_parallel", None) is not None):
            inner.update(id(m) for _, m in platform.named_modules(sub))
    found = {}
    for _, sub in platform.named_modules(module):
        if id(sub) in inner:
            continue
        for name, param in platform.named_parameters(sub):
            if param is None:
                continue
            found.setdefault(id(param), (param, []))[1].append((sub, name))
    return list(found.values())


def _unshard(state, async_op):
    """Gather the module's parameters now; with ``async_op=True`` a handle whose ``wait()`` completes it."""
    if state.schedule is None:
        state._lazy_init()
    state.group.unshard()
    handle = _UnshardHandle(state.group)
    if async_op:
        return handle
    handle.wait()
    return None


class _UnshardHandle:
    def __init__(self, group):
        self._group = group

    def wait(self):
        self._group.wait_for_unshard()


def _set(module, field, flag, recurse):
    if not isinstance(flag, bool):
        raise ValueError(f"{field}: pass True or False, got {flag!r}")
    platform = get_platform()
    modules = [m for _, m in platform.named_modules(module)] if recurse else [module]
    for m in modules:
        state = getattr(m, "_hp_fsdp_state", None)
        if state is not None:
            setattr(state.group, field, flag)
