"""Classify the aten ops that reach a DTensor below autograd (see dtensor_base.py)."""
from typing import Any, Optional
import functools

import torch

aten = torch.ops.aten

_ALIAS = {aten.detach.default, aten.alias.default, aten.clone.default, aten._to_copy.default}
_LIKE = {aten.zeros_like.default, aten.ones_like.default, aten.empty_like.default,
         aten.full_like.default, aten.rand_like.default, aten.randn_like.default}
_NEW_LIKE = {aten.new_empty_strided.default, aten.new_empty.default, aten.new_zeros.default,
             aten.new_ones.default, aten.new_full.default}
_INPLACE_FILL = {aten.zero_.default, aten.fill_.Scalar, aten.fill_.Tensor, aten.copy_.default}
# In-place ops that change a tensor's shape or strides rather than its values.
_RESHAPE_IN_PLACE = {"t_", "transpose_", "swapdims_", "swapaxes_", "squeeze_", "unsqueeze_", "resize_",
                     "resize_as_", "as_strided_", "set_", "unfold_"}


@functools.lru_cache(maxsize=None)
def aten_kind(func: Any) -> Optional[str]:
    """One of "alias", "like", "new_like", "fill", "foreach", "random", "pointwise", "view",
    "reshape_in_place", "index_backward", "lazy_bit", or None (no generic rule)."""
    if func.overloadpacket.__name__ in _RESHAPE_IN_PLACE:
        return "reshape_in_place"
    if func.overloadpacket.__name__ in ("_conj", "_neg_view"):
        return "lazy_bit"
    if func in _NEW_LIKE:
        return "new_like"
    if func in _ALIAS:
        return "alias"
    if torch.Tag.nondeterministic_seeded in func.tags:
        # before "like" and "pointwise": a random op must draw what one device would draw
        return "random"
    if func in _LIKE:
        return "like"
    if func in _INPLACE_FILL:
        return "fill"
    name = func.overloadpacket.__name__
    if name.startswith("_foreach_"):
        return "foreach"
    if torch.Tag.pointwise in func.tags or _in_place_of_pointwise(func):
        return "pointwise"
    if func.is_view:
        return "view"
    if name in ("slice_backward", "select_backward"):
        return "index_backward"
    return None


def _in_place_of_pointwise(func):
    """``abs_``, ``mish_``, ``eq_``... : torch tags the out-of-place overload pointwise but not (all)
    in-place ones; an in-place op writing self with a pointwise op's result is pointwise too."""
    name = func.overloadpacket.__name__
    if not name.endswith("_") or name.startswith("_"):
        return False
    packet = getattr(aten, name[:-1], None)
    twin = getattr(packet, func._overloadname, None) if packet is not None else None
    return twin is not None and torch.Tag.pointwise in twin.tags


def foreach_to_single(func: Any, args: Any = None, kwargs: Any = None) -> Any:
    """Without ``args``: the single-tensor aten op that one position of a ``_foreach_*`` op performs,
    or None. With the foreach call's ``args`` / ``kwargs``: one ``(op, item_args, item_kwargs,
    copy_into_self)`` per list position, or None when no single op fits. ``copy_into_self``: aten has
    no in-place form of the op (``_foreach_maximum_``), so the caller copies the result into self.

    The single op is chosen by the item's argument types, not by overload name: the foreach
    overloads (Scalar / ScalarList / List / Tensor) do not line up with the single ops' names, and
    a foreach scalar is positional where the single op's is keyword-only (``addcmul_``'s value)."""
    name = func.overloadpacket.__name__[len("_foreach_"):]
    if args is None:
        packet = getattr(aten, name, None)
        return None if packet is None else next((getattr(packet, o) for o in packet.overloads()
                                                 if "out" not in o), None)
    kwargs = dict(kwargs or {})
    items = _foreach_items(func, args)
    if name == "norm":  # (self, ord=2, dtype=None) -> linalg_vector_norm(self, ord, *, dtype=)
        dtype = kwargs.pop("dtype", None)
        calls = [(aten.linalg_vector_norm.default, [a[0], a[1] if len(a) > 1 else 2],
                  {} if (len(a) < 3 or a[2] is None) and dtype is None else {"dtype": dtype or a[2]}, False)
                 for a in items]
        return calls
    copy_back = not hasattr(aten, name) and name.endswith("_")
    packet = getattr(aten, name[:-1] if copy_back else name, None)
    if packet is None or not items:
        return None
    for overload in packet.overloads():
        op = getattr(packet, overload)
        bound = _bind(op._schema, items[0], kwargs)
        if bound is not None and "out" not in overload:
            return [(op,) + _bind(op._schema, item, kwargs) + (copy_back,) for item in items]
    return None


def _foreach_items(func, args):
    """The per-position argument lists of a foreach call: list arguments (``Tensor[]``, ``Scalar[]``)
    give their i-th entry, a ``Tensor scalars`` argument its i-th value, the rest pass whole."""
    schema = func._schema.arguments
    n = next(len(a) for a, s in zip(args, schema) if _is_list(s))
    items = []
    for i in range(n):
        item = []
        for value, arg in zip(args, schema):
            if _is_list(arg):
                value = value[i]
            elif arg.name == "scalars" and isinstance(value, torch.Tensor):
                value = value[i].item()
            item.append(value)
        items.append(item)
    return items


def _is_list(arg):
    return arg.type.kind() == "ListType"


def _fits(arg, value):
    kind = arg.type.kind()
    if kind == "OptionalType":
        if value is None:
            return True
        kind = arg.type.getElementType().kind()
    if kind == "TensorType":
        return isinstance(value, torch.Tensor)
    if kind == "NumberType":
        return isinstance(value, (bool, int, float, complex))
    return True


def _bind(schema, values, kwargs):
    """``values`` (positional, then spilling into keyword-only arguments in order) and ``kwargs``
    bound to ``schema`` as (args, kwargs), or None if they do not fit its arguments or types."""
    positional = [a for a in schema.arguments if not a.kwarg_only]
    keyword = [a for a in schema.arguments if a.kwarg_only]
    if len(values) > len(positional) + len(keyword):
        return None
    bound_kwargs = {}
    for arg, value in zip(keyword, values[len(positional):]):
        bound_kwargs[arg.name] = value
    names = {a.name: a for a in schema.arguments}
    for key, value in kwargs.items():
        if key not in names:
            return None
        bound_kwargs[key] = value
    pairs = list(zip(positional, values)) + [(names[k], v) for k, v in bound_kwargs.items()]
    if not all(_fits(arg, value) for arg, value in pairs):
        return None
    given = {a.name for a, _ in pairs}
    if any(not a.has_default_value() and a.name not in given and a.type.kind() != "OptionalType"
           for a in schema.arguments):
        return None
    return list(values[:len(positional)]), bound_kwargs


# Ops that write into arguments their schema does not mark as written (the running statistics).
_UNMARKED_WRITES = {"native_batch_norm": ("running_mean", "running_var"),
                    "cudnn_batch_norm": ("running_mean", "running_var"),
                    "miopen_batch_norm": ("running_mean", "running_var")}


@functools.lru_cache(maxsize=None)
def written_arguments(func: Any) -> Any:
    """(position, name) of every schema argument ``func`` writes into."""
    schema = func._schema
    extra = _UNMARKED_WRITES.get(func.overloadpacket.__name__, ())
    return tuple((i, arg.name) for i, arg in enumerate(schema.arguments)
                 if (arg.alias_info is not None and arg.alias_info.is_write) or arg.name in extra)
