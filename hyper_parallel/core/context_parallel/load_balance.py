"""Head-tail load balancing for causal attention (see HeadTailShard).

Rank r owns sequence chunks 2r and 2r+1 of 2n. It keeps chunk 2r (the head) and swaps chunk 2r+1
with partner rank n-1-r, receiving chunk 2n-1-2r (the tail); outputs go back the same way. One
half-block each way per rank, differentiable (the backward is the reverse exchange).

The ring re-lays its blocks (``zigzag_block``) and joins its output's gradient (``zigzag_halves``)
with their memory in the block kernels' (batch, heads, seq, dim) order, whatever the caller's
layout: those copies are made anyway, and the ring then reads q, k, v and the output gradient
without a contiguous copy of its own per head group (in backward, that copy was held beside the
joined gradient at the ring's peak).
"""
from typing import Any
from hyper_parallel.platform import get_platform


def partner_rank(mesh: Any, cp_dim: Any) -> Any:
    ranks = mesh.group_ranks(cp_dim)
    return ranks[len(ranks) - 1 - mesh.get_local_rank(cp_dim)]


def split_head_tail(local: Any, seq_dim: Any, mesh: Any, cp_dim: Any) -> Any:
    """(head, tail) local blocks this rank computes."""
    head, second = local.chunk(2, seq_dim)
    return head, _swap(second, mesh, cp_dim)


def merge_head_tail(head_out: Any, tail_out: Any, seq_dim: Any, mesh: Any, cp_dim: Any) -> Any:
    """This rank's contiguous output block from the head and tail results."""
    return get_platform().cat([head_out, _swap(tail_out, mesh, cp_dim)], seq_dim)


def zigzag_block(local: Any, seq_dim: Any, head_dim: Any, mesh: Any, cp_dim: Any) -> Any:
    """This rank's head chunk and the tail received from its partner, joined along ``seq_dim`` in
    one new tensor laid out in kernel order (see the module docstring)."""
    order = _kernel_order(local.ndim, seq_dim, head_dim)
    halves = split_head_tail(local, seq_dim, mesh, cp_dim)
    if order is None:
        return get_platform().cat(list(halves), seq_dim)
    joined = get_platform().cat([h.permute(*order) for h in halves], order.index(seq_dim))
    return joined.permute(*_inverse(order))


def zigzag_halves(block: Any, seq_dim: Any, head_dim: Any) -> Any:
    """(head, tail) halves of the ring's output ``block``: views whose gradients autograd joins in
    kernel order (the backward of a split is a concatenation in the split's own dim order)."""
    order = _kernel_order(block.ndim, seq_dim, head_dim)
    if order is None:
        return block.chunk(2, seq_dim)
    return tuple(h.permute(*_inverse(order)) for h in block.permute(*order).chunk(2, order.index(seq_dim)))


def _kernel_order(ndim, seq_dim, head_dim):
    """The dim order whose contiguous memory a (..., heads, seq, dim) view reads contiguously, or
    None where the layout has no separate trailing head-size dim (kept as it is)."""
    if head_dim is None:
        return None
    seq_dim, head_dim = seq_dim % ndim, head_dim % ndim
    if ndim - 1 in (seq_dim, head_dim) or seq_dim == head_dim:
        return None
    return [d for d in range(ndim - 1) if d not in (seq_dim, head_dim)] + [head_dim, seq_dim, ndim - 1]


def _inverse(order):
    return [order.index(d) for d in range(len(order))]


def _swap(tensor, mesh, cp_dim):
    partner = partner_rank(mesh, cp_dim)
    if partner == mesh.get_rank():
        return tensor
    return get_platform().differentiable_p2p_exchange(tensor.contiguous(), partner, partner)
