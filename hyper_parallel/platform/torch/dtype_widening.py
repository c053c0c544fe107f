"""Dtypes a backend cannot carry travel widened.

gloo rejects 16-bit and wide unsigned integers ("Invalid scalar type"), so a DTensor of int16 could
not be redistributed. Such tensors are widened to a signed integer type that holds every value
(int16 / uint16 -> int32, uint32 -> int64) for the collective and narrowed back after it. That is
exact for data movement and for max / min; sums wrap around as they do in the narrow type.
"""
from typing import Any
import functools

import torch
import torch.distributed as dist

_WIDER = {torch.int16: torch.int32}
for _name, _wide in (("uint16", torch.int32), ("uint32", torch.int64)):
    if hasattr(torch, _name):
        _WIDER[getattr(torch, _name)] = _wide


def _map(obj, fn):
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map(x, fn) for x in obj)
    return obj


def _narrow_dtype(obj):
    found = []
    _map(obj, lambda t: found.append(t.dtype) if t.dtype in _WIDER else None)
    return found[0] if found else None


def _needs_widening():
    return dist.get_backend() == "gloo"  # one backend per job: the default group's


def widening(method: Any) -> Any:
    """Decorate a Collectives method whose tensors (first positional argument, nested lists and
    (tensor, peer) pairs included) may have a dtype the backend lacks."""
    @functools.wraps(method)
    def wrapped(self, payload, *args, **kwargs):
        narrow = _narrow_dtype(payload)
        if narrow is None or not _needs_widening():
            return method(self, payload, *args, **kwargs)
        wide = _WIDER[narrow]
        widened = _map(payload, lambda t: t.to(wide) if t.dtype == narrow else t)
        result = method(self, widened, *args, **kwargs)
        back = functools.partial(_map, fn=lambda t: t.to(narrow) if t.dtype == wide else t)
        if hasattr(result, "wait"):
            inner = result.wait
            result.wait = lambda: back(inner())
            return result
        return back(result)
    return wrapped
