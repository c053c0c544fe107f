"""Classify the aten ops that reach a DTensor below autograd (see dtensor_base.py)."""
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
def aten_kind(func):
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
    if torch.Tag.pointwise in func.tags:
        return "pointwise"
    if func.is_view:
        return "view"
    if name in ("slice_backward", "select_backward"):
        return "index_backward"
    return None


def foreach_to_single(func):
    """The single-tensor aten op that one position of a ``_foreach_*`` op performs, or None."""
    name = func.overloadpacket.__name__[len("_foreach_"):]
    packet = getattr(aten, name, None)
    if packet is None:
        return None
    overload = func._overloadname
    for candidate in (overload, overload.replace("List", "Tensor"), "Tensor", "Scalar", "default"):
        op = getattr(packet, candidate, None)
        if op is not None:
            return op
    return None


# Ops that write into arguments their schema does not mark as written (the running statistics).
_UNMARKED_WRITES = {"native_batch_norm": ("running_mean", "running_var"),
                    "cudnn_batch_norm": ("running_mean", "running_var"),
                    "miopen_batch_norm": ("running_mean", "running_var")}


@functools.lru_cache(maxsize=None)
def written_arguments(func):
    """(position, name) of every schema argument ``func`` writes into."""
    schema = func._schema
    extra = _UNMARKED_WRITES.get(func.overloadpacket.__name__, ())
    return tuple((i, arg.name) for i, arg in enumerate(schema.arguments)
                 if (arg.alias_info is not None and arg.alias_info.is_write) or arg.name in extra)
