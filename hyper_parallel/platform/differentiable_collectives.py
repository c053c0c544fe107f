"""Collectives as autograd functions, written once for every platform.

Each is built with the platform's own ``make_autograd_function`` on top of its raw collectives, so
torch and MindSpore share one definition of every backward. Each backward is the adjoint collective
of its forward, run on a contiguous gradient: gloo returns wrong results (all-gather) or refuses
(all-to-all) for non-contiguous inputs, and MindSpore's kernels read the storage as laid out.
"""
from typing import Any


def _all_gather_forward(ctx, tensor, platform, group, dim):
    ctx.platform, ctx.group, ctx.dim = platform, group, dim
    return platform.all_gather(tensor, group, dim)


def _all_gather_backward(ctx, grad):
    return ctx.platform.reduce_scatter(grad.contiguous(), ctx.group, ctx.dim, "sum"), None, None, None


def _reduce_scatter_forward(ctx, tensor, platform, group, dim):
    ctx.platform, ctx.group, ctx.dim = platform, group, dim
    return platform.reduce_scatter(tensor, group, dim, "sum")


def _reduce_scatter_backward(ctx, grad):
    return ctx.platform.all_gather(grad.contiguous(), ctx.group, ctx.dim), None, None, None


def _all_to_all_forward(ctx, tensor, platform, group, split_dim, concat_dim):
    ctx.platform, ctx.group, ctx.split_dim, ctx.concat_dim = platform, group, split_dim, concat_dim
    return platform.all_to_all_single(tensor, group, split_dim, concat_dim)


def _all_to_all_backward(ctx, grad):
    # the inverse all-to-all: split where forward concatenated, concatenate where it split
    out = ctx.platform.all_to_all_single(grad.contiguous(), ctx.group, ctx.concat_dim, ctx.split_dim)
    return out, None, None, None, None


def _all_reduce_forward(ctx, tensor, platform, group, op, mode):
    """``mode="sum"``: the gradient of the sum of every rank's loss (each rank's downstream
    differs). ``mode="identity"``: downstream is replicated, every rank already holds the whole
    gradient (Megatron's "g" operator)."""
    out = platform.all_reduce(tensor, group, op)
    ctx.platform, ctx.group, ctx.op, ctx.mode = platform, group, op, mode
    ctx.share = None
    if op in ("max", "min"):
        # the gradient flows only to the elements that won, split evenly over ties across ranks
        # (the convention of torch.amax); a NaN wins, as in torch.max
        winners = ((tensor == out) | (tensor.isnan() & out.isnan())).to(tensor.dtype)
        ctx.share = winners / platform.all_reduce(winners, group, "sum").clamp(min=1)
    return out


def _all_reduce_backward(ctx, grad):
    grad = grad.contiguous()
    if ctx.mode == "sum":
        grad = ctx.platform.all_reduce(grad, ctx.group, "sum")
    if ctx.op == "avg":
        grad = grad / ctx.platform.get_world_size(ctx.group)
    elif ctx.share is not None:
        grad = grad * ctx.share
    return grad, None, None, None, None


def _p2p_forward(ctx, tensor, platform, send_to, recv_from, group):
    """Send ``tensor`` to ``send_to``, receive a same-shaped one from ``recv_from``."""
    ctx.platform, ctx.send_to, ctx.recv_from, ctx.group = platform, send_to, recv_from, group
    (out,) = platform.p2p_exchange([(tensor, send_to)], [(tensor, recv_from)], group)
    return out


def _p2p_backward(ctx, grad):
    # the reverse exchange: the gradient returns to where its value came from
    (out,) = ctx.platform.p2p_exchange([(grad.contiguous(), ctx.recv_from)], [(grad, ctx.send_to)],
                                       ctx.group)
    return out, None, None, None, None


_DEFINITIONS = {
    "all_gather": ("AllGather", _all_gather_forward, _all_gather_backward),
    "reduce_scatter": ("ReduceScatter", _reduce_scatter_forward, _reduce_scatter_backward),
    "all_to_all": ("AllToAll", _all_to_all_forward, _all_to_all_backward),
    "all_reduce": ("AllReduce", _all_reduce_forward, _all_reduce_backward),
    "p2p_exchange": ("P2PExchange", _p2p_forward, _p2p_backward),
}


class DifferentiableCollectives:
    """The five differentiable collectives of one platform (its autograd functions, built once)."""

    def __init__(self, platform: Any) -> None:
        self._platform = platform
        self._fns = {key: platform.make_autograd_function(name, forward, backward)
                     for key, (name, forward, backward) in _DEFINITIONS.items()}

    def all_gather(self, tensor: Any, group: Any, dim: int = 0) -> Any:
        return self._fns["all_gather"](tensor, self._platform, group, dim)

    def reduce_scatter(self, tensor: Any, group: Any, dim: int = 0) -> Any:
        return self._fns["reduce_scatter"](tensor, self._platform, group, dim)

    def all_to_all(self, tensor: Any, group: Any, split_dim: Any, concat_dim: Any) -> Any:
        return self._fns["all_to_all"](tensor, self._platform, group, split_dim, concat_dim)

    def all_reduce(self, tensor: Any, group: Any, op: str = "sum", backward: str = "sum") -> Any:
        return self._fns["all_reduce"](tensor, self._platform, group, op, backward)

    def p2p_exchange(self, tensor: Any, send_to: Any, recv_from: Any, group: Any = None) -> Any:
        return self._fns["p2p_exchange"](tensor, self._platform, send_to, recv_from, group)
