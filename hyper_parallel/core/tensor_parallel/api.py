"""parallelize_module: apply parallel styles to a module tree."""
from typing import Any
import fnmatch
import warnings

from hyper_parallel.core.dtensor.device_mesh import current_mesh
from hyper_parallel.core.tensor_parallel.style import ParallelStyle, check_tp_mesh
from hyper_parallel.platform import get_platform

__all__ = ["parallelize_module"]


def parallelize_module(module: Any, device_mesh: Any = None, parallelize_plan: Any = None, *,
                       src_data_rank: int = 0) -> Any:
    """Parallelize ``module`` in place over a 1-D tensor-parallel mesh and return it.

    ``parallelize_plan`` is a :class:`ParallelStyle` (applied to ``module`` itself) or a dict
    ``{fqn_pattern: style}``. A pattern is a dotted path of submodule names in which each segment
    is matched with ``fnmatch`` (``"layers.*.attention.wq"``, ``"feed_forward.w[13]"``); a value may
    also be a nested plan dict, relative to the matched submodule.

    ``device_mesh`` defaults to the mesh entered with ``with mesh:``. It must be 1-D: on an n-D
    mesh pass the tensor-parallel slice, e.g. ``mesh["tp"]``.

    ``src_data_rank``: the rank within ``device_mesh`` (as in PyTorch: 0 is the first rank of each
    tensor-parallel group) whose parameter values are sharded out; the others' initial values are
    ignored. ``None`` makes every rank slice its own copy (no data moves; a small metadata check
    still confirms that every rank's parameter has the same shape and dtype).
    """
    if device_mesh is None:
        device_mesh = current_mesh()
        if device_mesh is None:
            raise ValueError("parallelize_module needs a device_mesh: pass one, or call it inside "
                             "`with mesh:` (a 1-D tensor-parallel mesh such as mesh['tp'])")
    check_tp_mesh(device_mesh, "parallelize_module")
    if parallelize_plan is None:
        warnings.warn("parallelize_module got no parallelize_plan; the module is returned unchanged",
                      stacklevel=2)
        return module
    if isinstance(parallelize_plan, ParallelStyle):
        parallelize_plan.src_data_rank = src_data_rank
        return parallelize_plan.apply(module, device_mesh)
    if not isinstance(parallelize_plan, dict):
        raise ValueError(f"parallelize_plan must be a ParallelStyle or a dict {{fqn_pattern: style}}, got "
                         f"{type(parallelize_plan).__name__}")
    for pattern, style in parallelize_plan.items():
        if not isinstance(pattern, str) or not pattern:
            raise ValueError(f"parallelize_plan keys must be non-empty module paths, got {pattern!r}")
        if not isinstance(style, (ParallelStyle, dict)):
            raise ValueError(f"parallelize_plan[{pattern!r}] must be a ParallelStyle or a plan dict, got "
                             f"{type(style).__name__}")
        matched = _apply_pattern(module, pattern.split("."), style, device_mesh, src_data_rank, "")
        if not matched:
            children = [name for name, _ in get_platform().named_children(module)]
            warnings.warn(f"parallelize_module: plan entry {pattern!r} matched no submodule of "
                          f"{type(module).__name__} (children: {children}); it was ignored", stacklevel=2)
    return module


def _apply_pattern(module, atoms, style, mesh, src_data_rank, prefix):
    """Apply ``style`` to every submodule whose path matches ``atoms``; return how many. A style
    that rejects a module raises a ValueError that starts with the module's fully qualified name."""
    head, rest = atoms[0], atoms[1:]
    count = 0
    for name, child in get_platform().named_children(module):
        if not fnmatch.fnmatchcase(name, head):
            continue
        fqn = f"{prefix}{name}"
        if rest:
            count += _apply_pattern(child, rest, style, mesh, src_data_rank, fqn + ".")
            continue
        try:
            parallelize_module(child, mesh, style, src_data_rank=src_data_rank)
        except ValueError as exc:
            raise _named(exc, fqn, child) from exc
        count += 1
    return count


def _named(exc, fqn, child):
    """``exc`` with the module's path (from the top of the plan) in front of its message."""
    inner = getattr(exc, "hp_fqn", None)
    path = f"{fqn}.{inner[0]}" if inner else fqn
    kind = inner[1] if inner else type(child).__name__
    reason = inner[2] if inner else str(exc)
    error = ValueError(f"parallelize_module: module {path!r} ({kind}): {reason}")
    error.hp_fqn = (path, kind, reason)
    return error
