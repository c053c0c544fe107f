"""Module buffers and tensor factories for the torch platform (distribute_module, DTensor factories)."""
import torch


def named_buffers(module, recurse=False):
    return module.named_buffers(recurse=recurse)


def set_buffer(module, name, value):
    module.register_buffer(name, value, persistent=name not in module._non_persistent_buffers_set)


def create_tensor(kind, shape, dtype=None, device=None, fill_value=None):
    """torch.<kind> (zeros / ones / empty / full / rand / randn) of ``shape``."""
    extra = (fill_value,) if kind == "full" else ()
    return getattr(torch, kind)(tuple(shape), *extra, dtype=dtype, device=device)


PLATFORM_METHODS = tuple(staticmethod(f) for f in (named_buffers, set_buffer, create_tensor))
