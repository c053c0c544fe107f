"""Head-tail load balancing for causal attention (see HeadTailShard).

Rank r owns sequence chunks 2r and 2r+1 of 2n. It keeps chunk 2r (the head) and swaps chunk 2r+1
with partner rank n-1-r, receiving chunk 2n-1-2r (the tail); outputs go back the same way. One
half-block each way per rank, differentiable (the backward is the reverse exchange).
"""
from hyper_parallel.platform import get_platform


def partner_rank(mesh, cp_dim):
    ranks = mesh.group_ranks(cp_dim)
    return ranks[len(ranks) - 1 - mesh.get_local_rank(cp_dim)]


def split_head_tail(local, seq_dim, mesh, cp_dim):
    """(head, tail) local blocks this rank computes."""
    head, second = local.chunk(2, seq_dim)
    return head, _swap(second, mesh, cp_dim)


def merge_head_tail(head_out, tail_out, seq_dim, mesh, cp_dim):
    """This rank's contiguous output block from the head and tail results."""
    return get_platform().cat([head_out, _swap(tail_out, mesh, cp_dim)], seq_dim)


def _swap(tensor, mesh, cp_dim):
    partner = partner_rank(mesh, cp_dim)
    if partner == mesh.get_rank():
        return tensor
    return get_platform().differentiable_p2p_exchange(tensor.contiguous(), partner, partner)
