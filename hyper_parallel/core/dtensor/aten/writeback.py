"""Writes through views of DTensors.

A view op on a DTensor sometimes has to move data first (a slice across a sharded dim gathers that
dim; an aten-level view with no rule takes the replicated fallback). Its result then holds its own
memory, and torch's promise that an in-place write into a view changes the base would be silently
broken: ``d[1:3] = 0`` or ``v = d[1:3]; v.mul_(0)`` would leave ``d`` as it was.

So each such result remembers its base and how to take the view again (:func:`mark`). After an
in-place op on it, :func:`write_back` takes the same view of the base's full value, copies the new
values in, and lays the base out again in its own placements — through every level of a chain of
views. Where torch itself would have copied (``reshape`` of a non-viewable layout), nothing is
written back, as on one device.

Gradients: a view taken by an aten op (the path of ``d[idx] = v``) is known to autograd, which
records the write on the base as it does for any tensor. A view taken by a user-level rule is not,
so a write through it into a base that autograd tracks would give wrong gradients; that case
raises instead.
"""
from typing import Any
from hyper_parallel.platform import get_platform
from hyper_parallel.core.dtensor.dtensor import DTensor, as_layout
from hyper_parallel.core.dtensor.placement_types import Replicate

_ATTR = "_hp_view_of"


class _Link:
    __slots__ = ("base", "region", "autograd_view")

    def __init__(self, base, region, autograd_view):
        self.base, self.region, self.autograd_view = base, region, autograd_view


def mark(out: Any, base: Any, region: Any, autograd_view: Any) -> None:
    """``out`` is ``region(base)``, computed on moved data. ``region(full)`` takes the same view of
    a plain tensor holding the base's full value."""
    setattr(out, _ATTR, _Link(base, region, autograd_view))


def is_marked(tensor: Any) -> bool:
    return getattr(tensor, _ATTR, None) is not None


def check_writable(view: Any) -> None:
    """Raise before an in-place write into a view that autograd does not know as one (taken by a
    user-level view op from a DTensor that requires grad): the write could not reach the base's
    gradient."""
    link = getattr(view, _ATTR, None)
    if link is None or link.autograd_view or not get_platform().is_grad_enabled():
        return
    if link.base.requires_grad or view.requires_grad:
        raise ValueError("an in-place write into a view (transpose/view/split...) of a DTensor that requires "
                         "grad: autograd would not see it reach the base. Write into the base itself "
                         "(base[idx] = value), use the out-of-place op, or clone() the view first")


def write_back(view: Any) -> None:
    """Propagate an in-place change of ``view`` into its base (and the base's base...)."""
    link = getattr(view, _ATTR, None)
    if link is None:
        return
    platform = get_platform()
    base = link.base
    with platform.no_grad():
        full_spec = base._spec.with_placements(_replicated(base._spec))
        full = as_layout(base, full_spec)._local_tensor.clone()
        target = link.region(full)
        if not platform.shares_memory(target, full):
            return  # torch copies in this case too: the base does not change
        target.copy_(as_layout(view, view._spec.with_placements(_replicated(view._spec)))._local_tensor)
        base._local_tensor.copy_(as_layout(DTensor._make(full, full_spec), base._spec)._local_tensor)
    write_back(base)


def _replicated(spec):
    return (Replicate(),) * spec.mesh.ndim


__all__ = ["check_writable", "is_marked", "mark", "write_back"]
