"""Calling a custom autograd Function without torch's Python ``Function.apply`` wrapper.

``torch.autograd.Function.apply`` binds default arguments for ``setup_context`` Functions, unwraps
dead functorch wrappers and asks whether a functorch transform is active, all in Python, before it
reaches the C apply that builds the node. On a small op that wrapper costs more than the node
itself, and DTensor dispatch builds one or two such nodes per op. Our Functions take ``ctx`` in
``forward`` (no ``setup_context``), so outside functorch transforms the C apply does the same.
"""
from typing import Any
import torch


def lean_apply(function_class: Any) -> Any:
    """``function_class.apply``, going straight to the C apply unless a functorch transform (vmap,
    grad...) is active; then torch's full path runs, which handles (or rejects) the transform.
    Not done here: unwrapping a dead functorch wrapper (a tensor leaked out of a finished
    transform); DTensor dispatch passes DTensors and local shards, never such wrappers."""
    c_apply = super(torch.autograd.Function, function_class).apply
    full_apply = function_class.apply
    transforms_active = torch._C._are_functorch_transforms_active

    def apply(*args):
        if transforms_active():
            return full_apply(*args)
        return c_apply(*args)
    apply.function_class = function_class  # type: ignore[attr-defined]
    return apply
