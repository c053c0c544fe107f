"""What a library's own measurement needs from the framework: element sizes, and a computation state
of its own (core/context_parallel/auto: the calibration and the tuning's stand-ins); and the states a
computation can be run in besides eager: fake tensors (the dry run) and a compiled graph.

``Platform`` in base.py inherits it; torch overrides both (platform/torch/compute_state.py),
MindSpore the element size (platform/mindspore/compute_state.py).
"""
from typing import Any
import contextlib

from hyper_parallel.platform.training_contract import unavailable


class ComputeStateContract:
    """Declared members of element sizes and the default computation state."""

    name: str   # the platform's name (base.py), in messages

    def dtype_itemsize(self, dtype: Any) -> int:
        """Bytes per element of ``dtype`` (float8: 1, bfloat16: 2, float32: 4), from the framework, never
        parsed from the dtype's name."""
        raise unavailable("dtype_itemsize (element sizes)", self)

    def default_compute_state(self) -> contextlib.AbstractContextManager:
        """Context manager: the framework's default computation state inside — gradients recorded, no
        inference mode, no autocast — whatever the caller had set. A framework without such global
        state: a context that changes nothing."""
        return contextlib.nullcontext()

    def is_fake(self, tensor: Any) -> bool:
        """Whether ``tensor`` has shapes but no values (torch's FakeTensorMode, used by the dry run of
        hyper_parallel.plan): a host read of it cannot happen. Frameworks without fake tensors: False."""
        return False

    def compile_module(self, module: Any, **compile_kwargs: Any) -> Any:
        """Compile ``module`` in place, its DTensor dispatch and collectives inside one graph
        (torch: compile_support.py, docs/compile.md). Frameworks without such a compiler refuse."""
        raise ValueError(f"compile=True: the {self.name} platform has no compiler path for parallelized "
                         f"modules (docs/compile.md); leave compile off")
