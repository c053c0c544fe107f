"""Classify the aten ops that reach a DTensor below autograd (see dtensor_base.py)."""
import torch

aten = torch.ops.aten

_ALIAS = {aten.detach.default, aten.alias.default, aten.clone.default, aten._to_copy.default,
          aten.view_as_real.default if hasattr(aten, "view_as_real") else None}
_LIKE = {aten.zeros_like.default, aten.ones_like.default, aten.empty_like.default,
         aten.full_like.default, aten.rand_like.default, aten.randn_like.default}
_NEW_LIKE = {aten.new_empty_strided.default, aten.new_empty.default, aten.new_zeros.default,
             aten.new_ones.default, aten.new_full.default}
_INPLACE_FILL = {aten.zero_.default, aten.fill_.Scalar, aten.fill_.Tensor, aten.copy_.default}


def aten_kind(func):
    """One of "alias", "like", "new_like", "fill", "foreach", "pointwise", or None (no generic rule)."""
    if func in _NEW_LIKE:
        return "new_like"
    if func in _ALIAS:
        return "alias"
    if func in _LIKE:
        return "like"
    if func in _INPLACE_FILL:
        return "fill"
    name = func.overloadpacket.__name__
    if name.startswith("_foreach_"):
        return "foreach"
    if torch.Tag.pointwise in func.tags:
        return "pointwise"
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
