"""What fully_shard needs from MindSpore (core/fully_shard/tuple_grads.py drives it).

MindSpore's gradients come as one tuple in the optimizer Parameters' shapes (gradients_as_tuple),
so its fully_shard gathers the shards inside the differentiated graph and installs the gathered
tensors as Cell attributes: ``swap_parameter`` is all it adds to collectives and autograd
functions. The members of torch's path (freeing and refilling a gathered parameter's memory in
place, per-parameter gradient hooks, a callback at the end of backward) have no MindSpore
counterpart -- a Tensor's memory cannot be resized in place and ``ms.grad`` returns gradients
instead of accumulating them -- and are not needed by that design: they raise, naming why.
"""
from typing import Any


def _not_needed(member):
    return NotImplementedError(
        f"{member} is not available on MindSpore (tensor memory cannot be resized in place; gradients "
        f"come back as a tuple, not through per-parameter hooks); MindSpore's fully_shard does not use it "
        f"(core/fully_shard/tuple_grads.py)")


class MindSporeFullyShardSupport:
    """Mixin of ``MindSporePlatform`` (see the module docstring)."""

    @staticmethod
    def swap_parameter(module: Any, name: str, value: Any) -> None:
        """Make ``module.<name>`` read as ``value`` in the Cell's code: set in the instance dict,
        which attribute lookup finds before ``Cell.__getattr__`` looks in ``_params`` (the Cell's
        registered Parameter, what the optimizer holds, stays the sharded one)."""
        object.__setattr__(module, name, value)

    @staticmethod
    def untracked(tensor: Any) -> Any:
        # MindSpore tensors carry no version counter for autograd to check
        return tensor

    @staticmethod
    def free_storage(tensor: Any) -> Any:
        raise _not_needed("free_storage")

    @staticmethod
    def alloc_storage(tensor: Any) -> Any:
        raise _not_needed("alloc_storage")

    @staticmethod
    def register_multi_grad_hook(tensors: Any, hook: Any, mode: str = "any") -> Any:
        raise _not_needed("register_multi_grad_hook")

    @staticmethod
    def is_autograd_leaf(tensor: Any) -> Any:
        raise _not_needed("is_autograd_leaf")

    @staticmethod
    def queue_backward_callback(callback: Any) -> Any:
        raise _not_needed("queue_backward_callback")
