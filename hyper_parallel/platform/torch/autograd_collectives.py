"""Collectives as autograd Functions.

Each backward is the adjoint collective of its forward, run on a contiguous gradient: gloo
returns wrong results (all-gather) or refuses (all-to-all) for non-contiguous inputs.
"""
import torch


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, comm, group, dim):
        ctx.comm, ctx.group, ctx.dim = comm, group, dim
        return comm.all_gather(tensor, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return ctx.comm.reduce_scatter(grad.contiguous(), ctx.group, ctx.dim, "sum"), None, None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, comm, group, dim):
        ctx.comm, ctx.group, ctx.dim = comm, group, dim
        return comm.reduce_scatter(tensor, group, dim, "sum")

    @staticmethod
    def backward(ctx, grad):
        return ctx.comm.all_gather(grad.contiguous(), ctx.group, ctx.dim), None, None, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, comm, group, split_dim, concat_dim):
        ctx.comm, ctx.group, ctx.split_dim, ctx.concat_dim = comm, group, split_dim, concat_dim
        return comm.all_to_all_single(tensor, group, split_dim, concat_dim)

    @staticmethod
    def backward(ctx, grad):
        # The inverse all-to-all: split where forward concatenated, concatenate where it split.
        out = ctx.comm.all_to_all_single(grad.contiguous(), ctx.group, ctx.concat_dim, ctx.split_dim)
        return out, None, None, None, None


class _AllReduce(torch.autograd.Function):
    """``backward="sum"``: the gradient of the sum of every rank's loss (each rank's downstream
    differs). ``backward="identity"``: downstream is replicated, every rank already holds the
    whole gradient (Megatron's "g" operator)."""

    @staticmethod
    def forward(ctx, tensor, comm, group, op, backward):
        out = comm.all_reduce(tensor, group, op)
        ctx.comm, ctx.group, ctx.op, ctx.mode = comm, group, op, backward
        if op in ("max", "min"):
            # Gradient flows only to the elements that won, split evenly over ties across ranks
            # (the convention of torch.amax); a NaN wins, as in torch.max.
            winners = ((tensor == out) | (tensor.isnan() & out.isnan())).to(tensor.dtype)
            ctx.save_for_backward(winners / comm.all_reduce(winners, group, "sum").clamp_min(1))
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        if ctx.mode == "sum":
            grad = ctx.comm.all_reduce(grad, ctx.group, "sum")
        if ctx.op == "avg":
            grad = grad / torch.distributed.get_world_size(ctx.group)
        elif ctx.op in ("max", "min"):
            (share,) = ctx.saved_tensors
            grad = grad * share
        return grad, None, None, None, None


class _P2PExchange(torch.autograd.Function):
    """Send ``tensor`` to ``send_to`` and receive a same-shaped tensor from ``recv_from``.
    The backward is the reverse exchange: the gradient returns to where its value came from."""

    @staticmethod
    def forward(ctx, tensor, comm, send_to, recv_from, group):
        ctx.comm, ctx.send_to, ctx.recv_from, ctx.group = comm, send_to, recv_from, group
        (out,) = comm.p2p_exchange([(tensor, send_to)], [(tensor, recv_from)], group)
        return out

    @staticmethod
    def backward(ctx, grad):
        (out,) = ctx.comm.p2p_exchange([(grad.contiguous(), ctx.recv_from)], [(grad, ctx.send_to)],
                                       ctx.group)
        return out, None, None, None, None


def all_gather(comm, tensor, group, dim=0):
    return _AllGather.apply(tensor, comm, group, dim)


def reduce_scatter(comm, tensor, group, dim=0):
    return _ReduceScatter.apply(tensor, comm, group, dim)


def all_to_all(comm, tensor, group, split_dim, concat_dim):
    return _AllToAll.apply(tensor, comm, group, split_dim, concat_dim)


def all_reduce(comm, tensor, group, op="sum", backward="sum"):
    return _AllReduce.apply(tensor, comm, group, op, backward)


def p2p_exchange(comm, tensor, send_to, recv_from, group=None):
    return _P2PExchange.apply(tensor, comm, send_to, recv_from, group)
