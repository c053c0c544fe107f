"""Module buffers and tensor factories for the torch platform (distribute_module, DTensor factories)."""
from typing import Any
import torch


def named_buffers(module: Any, recurse: bool = False) -> Any:
    return module.named_buffers(recurse=recurse)


def set_buffer(module: Any, name: str, value: Any) -> None:
    module.register_buffer(name, value, persistent=name not in module._non_persistent_buffers_set)


def create_tensor(kind: Any, shape: Any, dtype: Any = None, device: Any = None,
                  fill_value: Any = None) -> Any:
    """torch.<kind> (zeros / ones / empty / full / rand / randn) of ``shape``."""
    extra = (fill_value,) if kind == "full" else ()
    return getattr(torch, kind)(tuple(shape), *extra, dtype=dtype, device=device)


PLATFORM_METHODS = tuple(staticmethod(f) for f in (named_buffers, set_buffer, create_tensor))
