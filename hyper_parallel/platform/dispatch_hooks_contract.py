"""What core's DTensor dispatchers ask the framework about an op (moved out of base.py, which
inherits it). The defaults are those of a framework whose ops reach a DTensor at one level only
(MindSpore: PyNative ops return new tensors, never views); torch overrides them
(platform/torch/dispatch_hooks.py) for the aten level below autograd.
"""
from typing import Any, Optional, Tuple

from hyper_parallel.platform.training_contract import unavailable


class DispatchHooksContract:
    """Declared members of op classification and wrapper aliasing for the dispatchers."""

    @staticmethod
    def op_display_name(func: Any) -> str:
        """The op's name in messages and rule lookups."""
        return getattr(func, "__name__", None) or str(func)

    @staticmethod
    def aten_kind(func: Any) -> Optional[str]:
        """How the level below autograd treats ``func`` (torch's aten_kinds.py), None: no such level."""
        return None

    @staticmethod
    def foreach_to_single(func: Any, args: Any = None, kwargs: Any = None) -> Any:
        """A multi-tensor op as its per-position single-tensor calls, or None."""
        return None

    @staticmethod
    def op_returns_nothing(func: Any) -> bool:
        """Whether an op below autograd returns nothing (in-place foreach ops)."""
        return False

    @staticmethod
    def loss_parallel_unsupported() -> Optional[str]:
        """Why ``loss_parallel()``'s rules cannot reach this framework's cross-entropy, or None."""
        return None

    @staticmethod
    def written_arguments(func: Any) -> Tuple[Tuple[int, str], ...]:
        """(position, name) of every argument an op below autograd writes into."""
        return ()

    @staticmethod
    def alias_view_wrappers(func: Any, args: Any, kwargs: Any, out: Any) -> Any:
        """Make a view op's output wrapper(s) alias the input's, for autograd's view tracking."""
        return out

    @staticmethod
    def shares_memory(a: Any, b: Any) -> bool:
        """Whether two tensors are views of one storage."""
        return False

    @staticmethod
    def materialize(tensor: Any) -> Any:
        """A tensor with any lazy bits (torch's conjugate / negative views) applied."""
        return tensor

    def apply_to_wrapper(self, func: Any, wrapper: Any, args: Any, kwargs: Any) -> None:
        """Run a metadata-only in-place op on a DTensor's wrapper itself (its global shape)."""
        raise unavailable("in-place shape ops on a DTensor's wrapper", self)
