"""Peak memory of a region of code.

Accelerators report their allocator's peak. The CPU allocator keeps no statistics, so on CPU a
dispatch mode counts the bytes of every storage created inside the region for as long as the
storage lives (torch keeps a storage's Python object alive while any tensor, view or saved tensor
uses it).
"""
from typing import Any
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class _LiveBytes(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0
        self._seen = set()

    def _release(self, key, nbytes):
        self._seen.discard(key)
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (list, tuple)) else (out,)):
            if type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter:
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key in self._seen or storage.nbytes() == 0:
                continue
            self._seen.add(key)
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._release, key, storage.nbytes())
        return out


class PeakMemory:
    """``with PeakMemory(device_type) as m: ...`` then ``m.peak_bytes``."""

    def __init__(self, device_type: Any) -> None:
        self.device_type = device_type
        self.peak_bytes = 0

    def __enter__(self):
        if self.device_type == "cpu":
            self._mode = _LiveBytes()
            self._mode.__enter__()
        else:
            module = getattr(torch, self.device_type)
            module.synchronize()
            self._base = module.memory_allocated()
            module.reset_peak_memory_stats()
        return self

    def __exit__(self, *exc):
        if self.device_type == "cpu":
            self._mode.__exit__(*exc)
            self.peak_bytes = self._mode.peak
        else:
            module = getattr(torch, self.device_type)
            module.synchronize()
            self.peak_bytes = module.max_memory_allocated() - self._base
        return False
