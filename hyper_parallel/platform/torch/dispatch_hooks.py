"""torch's answers to the dispatchers' op questions (platform/dispatch_hooks_contract.py): the aten
level below autograd, where view ops alias their input and in-place ops write their arguments."""
from typing import Any

from torch.utils._mode_utils import no_dispatch
from torch.utils._python_dispatch import return_and_correct_aliasing

from hyper_parallel.platform.torch.aten_kinds import aten_kind, foreach_to_single, written_arguments


class TorchDispatchHooks:
    @staticmethod
    def aten_kind(func: Any) -> Any:
        return aten_kind(func)

    @staticmethod
    def op_returns_nothing(func: Any) -> bool:
        """Whether an aten op's schema lists no returns (the in-place foreach ops)."""
        return not func._schema.returns

    @staticmethod
    def foreach_to_single(func: Any, args: Any = None, kwargs: Any = None) -> Any:
        return foreach_to_single(func, args, kwargs)

    @staticmethod
    def written_arguments(func: Any) -> Any:
        """(position, name) of the arguments an aten op writes into."""
        return written_arguments(func)

    @staticmethod
    def apply_to_wrapper(func: Any, wrapper: Any, args: Any, kwargs: Any) -> None:
        """Run a metadata-only in-place op (``transpose_``, ``unsqueeze_``...) on a DTensor's
        wrapper itself, bypassing dispatch, so that its global sizes and strides follow."""
        with no_dispatch():
            func(wrapper, *args, **kwargs)

    @staticmethod
    def alias_view_wrappers(func: Any, args: Any, kwargs: Any, out: Any) -> Any:
        """Give the wrapper(s) a view op returns the sizes, strides and storage offset the op gives
        on the input's wrapper, so autograd's view tracking (CopySlices) addresses the right region
        of the base's gradient."""
        return return_and_correct_aliasing(func, args, kwargs, out)

    @staticmethod
    def materialize(tensor: Any) -> Any:
        """A tensor with its lazy conjugate / negative bits applied to its values."""
        return tensor.resolve_conj().resolve_neg()

    @staticmethod
    def shares_memory(a: Any, b: Any) -> bool:
        """Whether two tensors are views of one storage (a write into one shows in the other)."""
        return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
