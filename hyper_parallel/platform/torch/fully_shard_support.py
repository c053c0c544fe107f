"""What fully_shard needs from torch beyond collectives: freeing and re-allocating a parameter's
memory in place, writes autograd does not track, parameter swaps and backward hooks."""
from typing import Any, Callable, Literal

import torch


def free_storage(tensor: Any) -> None:
    """Resize the storage to nothing: the tensor object (and autograd's saved references to it)
    survive, so re-allocating and refilling it before backward makes them valid again."""
    storage = tensor.untyped_storage()
    if storage.size() != 0:
        storage.resize_(0)


def alloc_storage(tensor: Any) -> None:
    storage = tensor.untyped_storage()
    nbytes = (tensor.storage_offset() + tensor.numel()) * tensor.element_size()
    if storage.size() != nbytes:
        storage.resize_(nbytes)


def untracked(tensor: Any) -> Any:
    """``tensor.data``: same memory, its own version counter, so refilling a parameter that autograd
    saved in forward does not fail backward's "modified by an inplace operation" check."""
    return tensor.data


def swap_parameter(module: Any, name: str, value: Any) -> None:
    # straight into the registry: register_parameter would wrap a non-Parameter in a new object
    module._parameters[name] = value


def register_multi_grad_hook(tensors: Any, hook: Any, mode: Literal["all", "any"] = "any") -> Any:
    return torch.autograd.graph.register_multi_grad_hook(tuple(tensors), lambda grads: hook(), mode=mode)


def is_autograd_leaf(tensor: Any) -> bool:
    return tensor.grad_fn is None


def queue_backward_callback(callback: Any) -> None:
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def register_optimizer_step_pre_hook(hook: Callable) -> object:
    """``hook(optimizer, args, kwargs)`` before every ``step()`` of every torch optimizer (fully_shard
    checks there that an optimizer holds the parameters the model uses)."""
    from torch.optim import optimizer
    return optimizer.register_optimizer_step_pre_hook(hook)


def register_grad_arrival_hook(param: torch.Tensor, hook: Callable) -> object:
    """``hook(param)`` when a backward delivers a gradient for the leaf ``param``, before it is
    added to ``param.grad`` (data_parallel separates an already-reduced ``.grad`` there)."""
    return param.register_hook(lambda grad: hook(param))


# wrap-state checks (fully_shard, data_parallel): SPEC §19 "State changed after wrapping"
STATE_METHODS = (staticmethod(register_optimizer_step_pre_hook), staticmethod(register_grad_arrival_hook))

PLATFORM_METHODS = tuple(staticmethod(f) for f in (free_storage, alloc_storage, untracked, swap_parameter,
                                                   register_multi_grad_hook, is_autograd_leaf,
                                                   queue_backward_callback))
