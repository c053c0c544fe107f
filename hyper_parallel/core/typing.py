"""Names for the framework's types in core's signatures.

core/ never imports torch or MindSpore (the platform layer does), so a tensor or a module cannot be
named by its class here. These aliases are ``Any`` to the type checker, but a signature that says
``Tensor`` or ``Module`` tells its reader what to pass: the active platform's tensor
(``torch.Tensor`` / ``mindspore.Tensor``) or its module (``torch.nn.Module`` / ``mindspore.nn.Cell``).
"""
from typing import Any

Tensor = Any
"""The platform's tensor type: ``torch.Tensor`` on torch, ``mindspore.Tensor`` on MindSpore."""

Module = Any
"""The platform's module type: ``torch.nn.Module`` on torch, ``mindspore.nn.Cell`` on MindSpore."""

ProcessGroup = Any
"""The platform's communication group (a ``torch.distributed`` ProcessGroup or a MindSpore group name)."""

DType = Any
"""The platform's dtype (``torch.dtype`` / ``mindspore.dtype``)."""

__all__ = ["Tensor", "Module", "ProcessGroup", "DType"]
