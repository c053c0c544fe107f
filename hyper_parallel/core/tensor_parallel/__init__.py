"""Tensor parallelism: parallel styles, parallelize_module and loss_parallel."""
from hyper_parallel.core.tensor_parallel.api import parallelize_module
from hyper_parallel.core.tensor_parallel.loss import loss_parallel
from hyper_parallel.core.tensor_parallel.style import (ColwiseParallel, NoParallel, ParallelStyle,
                                                       PrepareModuleInput, PrepareModuleInputOutput,
                                                       PrepareModuleOutput, RowwiseParallel, SequenceParallel)

__all__ = ["ParallelStyle", "ColwiseParallel", "RowwiseParallel", "SequenceParallel", "PrepareModuleInput",
           "PrepareModuleOutput", "PrepareModuleInputOutput", "NoParallel", "parallelize_module",
           "loss_parallel"]
