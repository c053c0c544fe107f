"""Where ``torch.compile`` (dynamo) stops tracing this library and runs it eagerly.

Dynamo cannot trace core's DTensor machinery (per-signature caches, custom autograd nodes built
through the C apply, wrapper-subclass construction). Three kinds of entry are therefore graph
boundaries when a user compiles a parallelized model directly: a DTensor's ``__torch_function__``
and Python operators (``dtensor_base.py``), the module hooks the library registers (TP styles,
fully_shard, data_parallel) and the forwards it replaces (ContextParallel, expert parallel,
tiled MLP) (``platform.py``). Code between boundaries, on plain tensors, is compiled as usual.
``compile_support.compile_module`` avoids the boundaries altogether (docs/compile.md).
"""
from typing import Callable

import torch

dynamo_compiling = torch.compiler.is_dynamo_compiling   # constant-folded by dynamo while it traces


def eager_boundary(fn: Callable) -> Callable:
    """``fn`` run eagerly (not traced, a graph break) when reached from code dynamo compiles;
    outside torch.compile a plain call."""
    return torch.compiler.disable(fn, recursive=True)
