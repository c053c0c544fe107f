"""torch's profiler ranges (platform/observability_contract.py): ``record_function`` while a
profiler records, nothing otherwise (a RecordFunction costs an allocation and a dispatcher call
per collective; the check is one C call)."""
from typing import Any, ContextManager
import contextlib

import torch

_NO_RANGE = contextlib.nullcontext()


class TorchProfiling:
    @staticmethod
    def profile_range(name: str) -> ContextManager[Any]:
        # inside a compiled graph the range would be traced (a graph break on the profiler check)
        if torch.compiler.is_compiling() or not torch.autograd._profiler_enabled():
            return _NO_RANGE
        return torch.profiler.record_function(name)
