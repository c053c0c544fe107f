"""What fully_shard remembers from wrap time, and the checks that keep it true (SPEC §19 "State
changed after wrapping").

At wrap time a unit records, per parameter, the object it replaced (the user's Parameter) and
the sharded DTensor it installed, with the parameter's path. Three checks read that record:

- wrap time (``check_wrappable``): a parameter an earlier fully_shard call already took is
  either a weight tied across two units (sharded twice, each copy getting half the gradient) or
  a sign of top-down wrapping (the root first, so the blocks' parameters are already DTensors):
  both raise, naming the paths and the fix;
- every root forward (``sync_units``): per parameter, a few attribute reads compare what the
  module holds with the record. ``requires_grad`` and the dtype may change, as in one process
  (the unit adopts them); a parameter replaced by another object, or a tie undone or made after
  wrapping, raises. A change is then checked across the ranks (``core/agreement.py``);
- every optimizer step (``check_optimizer``, a global step pre-hook): an optimizer holding a
  Parameter fully_shard replaced (built before fully_shard, or before ``to_empty``) would step
  tensors no module uses and train nothing; it raises naming the fix.

The record is an ``IdentityTable`` (core/bounded_cache.py): an entry leaves with its object, so a
new object at a reused address never matches.
"""
from typing import Any, Optional

from hyper_parallel.core.agreement import check_agreement
from hyper_parallel.core.bounded_cache import IdentityTable, lifetime_key
from hyper_parallel.core.dtensor.dtensor import DTensor
from hyper_parallel.platform import get_platform

_REPLACED = IdentityTable()   # object -> text: objects fully_shard replaced (a module no longer uses them)
_SHARDED = IdentityTable()    # object -> text: the sharded DTensors fully_shard installed
_HOOKED = [False]


def _remember(table: IdentityTable, obj: Any, text: str) -> None:
    try:
        table[obj] = text
    except TypeError:   # an object without weak references: not recorded (no false match either)
        pass


def _lookup(table: IdentityTable, obj: Any) -> Optional[str]:
    return table.get(obj)


def module_paths(root: Any) -> dict:
    """id(module) -> dotted path under ``root`` ("" for the root)."""
    return {id(m): name for name, m in get_platform().named_modules(root)}


def describe(paths: dict, unit: Any, locations: list) -> str:
    module, attr = locations[0]
    path = paths.get(id(module))
    where = f"{path}.{attr}" if path else attr
    return f"'{where}' of the {type(unit).__name__} unit"


def check_wrappable(unit: Any, owned: list) -> None:
    """Before ``unit`` changes: none of its parameters may belong to another unit already."""
    paths = module_paths(unit)
    for param, locations in owned:
        here = describe(paths, unit, locations)
        earlier = _lookup(_SHARDED, param)
        if earlier is not None:
            raise ValueError(
                f"fully_shard({type(unit).__name__}): parameter {here} is already sharded by an earlier "
                f"fully_shard call on an enclosing module ({earlier}): fully_shard is applied bottom-up, "
                f"each block first and then the root (fully_shard(block) for every block, then "
                f"fully_shard(model))")
        earlier = _lookup(_REPLACED, param)
        if earlier is not None:
            raise ValueError(
                f"fully_shard({type(unit).__name__}): parameter {here} is the same Parameter as {earlier} "
                f"(another unit, which an earlier fully_shard call took): a weight tied across two units "
                f"would be sharded "
                f"twice and each copy would get only its own part of the gradient. Apply fully_shard to a "
                f"module that contains every use of the tied weight (their common ancestor, e.g. the root) "
                f"instead of to each separately, or untie the weights before fully_shard")


def record(param: Any, sharded: Any, text: str) -> None:
    """``param`` was replaced by ``sharded`` (the parameter ``text``)."""
    _remember(_REPLACED, param, text)
    _remember(_SHARDED, sharded, text)
    install_optimizer_check()


def retire(old_sharded: Any, text: str) -> None:
    """The module adopted a new sharded object (``to_empty``): the old one trains nothing any more."""
    _remember(_REPLACED, old_sharded, text)


# ---------------------------------------------------------------------- optimizers
def check_optimizer(optimizer: Any, args: tuple = (), kwargs: Optional[dict] = None) -> None:
    """Raise if ``optimizer`` holds a Parameter fully_shard replaced (it would train nothing)."""
    if not _REPLACED:
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            text = _lookup(_REPLACED, p)
            if text is not None:
                raise ValueError(
                    f"{type(optimizer).__name__}.step(): this optimizer holds parameter {text} as it was "
                    f"before fully_shard replaced it by its sharded DTensor (or before to_empty replaced "
                    f"that): stepping it would train nothing. Create the optimizer after fully_shard (and "
                    f"after to_empty): optimizer = {type(optimizer).__name__}(model.parameters(), ...)")


def install_optimizer_check() -> None:
    if not _HOOKED[0]:
        _HOOKED[0] = True
        get_platform().register_optimizer_step_pre_hook(check_optimizer)


# ---------------------------------------------------------------------- every forward
def _replaced_error(p: Any, current: Any) -> ValueError:
    """A parameter whose object changed: nothing fully_shard could adopt."""
    what = (f"a {type(current).__name__} of shape {tuple(current.shape)}" if current is not None
            else "nothing")
    return ValueError(
        f"fully_shard: parameter {p.text} now holds {what}, not the sharded parameter fully_shard installed: "
        f"a parameter assigned, re-tied or deleted after fully_shard is not sharded, gathered or reduced. "
        f"Make such changes before fully_shard (or copy new values in place: "
        f"with torch.no_grad(): param.copy_(value))")


def sync_param(p: Any, sharded_now: bool, may_retype: bool) -> bool:
    """Compare what the module holds for ``p`` with the record; adopt a changed ``requires_grad``
    or dtype (returns True), raise on anything else that changed."""
    held = [getattr(module, attr, None) for module, attr in p.locations]
    current = held[0]
    expected = p.sharded if sharded_now else p.unsharded
    if current is not expected:
        if not (sharded_now and isinstance(current, DTensor) and current._spec == p.sharded._spec):
            raise _replaced_error(p, current)
        retire(p.sharded, p.text)
        p.sharded = current
        p.swap(current)
        held = [current] * len(held)
    if any(h is not current for h in held[1:]):
        raise _replaced_error(p, next(h for h in held[1:] if h is not current))
    changed = False
    # the user may have changed either object (the sharded one, or the gathered one while held)
    flags = {bool(t.requires_grad) for t in (current, p.sharded) if t is not None} - {p.requires_grad}
    if flags:
        p.set_requires_grad(flags.pop())
        changed = True
    # (only while sharded: the gathered tensor has the compute dtype and no shard)
    if may_retype and (current.dtype != p.orig_dtype or current._local_tensor.dtype != current.dtype):
        # module.to(dtype) / .double() after wrapping: as in one process, the parameter keeps its
        # identity (the optimizer's) and takes the dtype; its shard follows the wrapper's dtype
        if current._local_tensor.dtype != current.dtype:
            current._local_tensor = current._local_tensor.to(current.dtype)
        p.orig_dtype = current.dtype
        changed = True
    return changed


def check_no_new_parameters(root: Any, states: list) -> None:
    """A Parameter added under the root after wrapping (a new attribute of a wrapped module) would be
    neither sharded, gathered nor reduced: each rank would keep its own gradient and the replicas
    would drift. Every parameter under the root is one a unit manages (its sharded or gathered
    form) or a DTensor another parallelism placed (tensor or expert parallel)."""
    known = {id(t) for s in states for p in s.group.params for t in (p.sharded, p.unsharded)}
    for name, param in get_platform().named_parameters(root, recurse=True):
        if id(param) not in known and not isinstance(param, DTensor):
            raise ValueError(
                f"fully_shard: parameter '{name}' of {type(root).__name__} was added after fully_shard: it "
                f"is not sharded, gathered or reduced, so each rank would train its own copy. Add parameters "
                f"before fully_shard (build the module, then wrap it)")


def agree(mesh: Any, states: list, schedule: Any) -> None:
    """The units' parameters (shapes, dtypes, requires_grad) and unit order agree on every rank."""
    settings = {"number of fully_shard units": len(states),
                "unit classes": tuple(type(s.module).__name__ for s in states)}
    for s in states:   # per unit: (path, shape, dtype, requires_grad) of each parameter
        settings[f"parameters of unit {s.path!r}"] = tuple(
            (p.text.strip("'"), tuple(p.unsharded_shape), str(p.orig_dtype).replace("torch.", ""),
             p.requires_grad) for p in s.group.params)
    check_agreement(mesh, "fully_shard", settings, signature=("wrap state", lifetime_key(schedule)),
                    fix="build the same model on every rank, apply fully_shard to the same modules, and "
                        "freeze / unfreeze / cast the same parameters on every rank")


def agree_at_wrap(mesh: Any, unit: Any, owned: list) -> None:
    """Wrap time (the tuple-gradient path, whose units have no root forward to check at): every
    rank wraps a module of this class with parameters of the same paths, shapes and dtypes."""
    paths = module_paths(unit)
    check_agreement(mesh, "fully_shard", {
        "unit class": type(unit).__name__,
        "parameters of the unit": tuple((describe(paths, unit, locations), tuple(int(s) for s in param.shape),
                                         str(param.dtype)) for param, locations in owned),
    }, signature=("wrap", lifetime_key(unit)),
        fix="build the same model on every rank and apply fully_shard to the same modules in the same order")


def agree_call(mesh: Any, state: Any, calls: int) -> None:
    """A unit's all-gather is about to run: every rank is at the same unit and call."""
    check_agreement(mesh, "fully_shard unit call",
                    {"unit": state.path, "call of the unit in this forward": calls},
                    signature=("unit call", lifetime_key(state.schedule)),
                    fix="call every fully_shard unit the same number of times, in the same order, on every "
                        "rank (a unit a rank would skip must be called with empty input instead)")
