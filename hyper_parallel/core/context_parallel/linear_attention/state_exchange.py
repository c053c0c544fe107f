"""The exact incoming state of each rank's block, and its gradient, as two autograd functions.

Rank r's block maps the state it receives to the state it hands on affinely:
S_out = M_r · S_in + S_r (M_r: d_k × d_k, S_r: d_k × d_v per head; chunk_rule.block_summary).

``allgather``: the summaries [M_r | S_r] travel in ONE all-gather; rank r folds those of ranks
0..r−1 onto the initial state. Backward runs the fold backwards (grad M_j = G · S_in,jᵀ, grad S_j = G,
G ← M_jᵀ G) and one reduce-scatter hands every rank the sum of its summary's gradients.
``p2p``: rank r receives S_in from r−1 and sends M_r · S_in + S_r to r+1 (P−1 hops in sequence,
each an affine map, not a rerun of the block); backward sends the state gradient back along the chain.

Bytes per head: allgather P · d_k · (d_k + d_v) received per rank (and the same in backward);
p2p d_k · d_v per hop. Neither depends on the sequence length.

The initial state is the same on every rank; its gradient is summed over the ranks (one
all-reduce in backward, only when it requires grad), so every rank holds the whole gradient.
"""
from typing import Any
from hyper_parallel.core.autograd_functions import lazy_autograd_function
from hyper_parallel.platform import get_platform


def _fold(summaries, start, count, d_k):
    """States entering blocks 0..count of the chain from ``start`` (count + 1 states)."""
    states = [start]
    for j in range(count):
        m, s = summaries[j][..., :d_k], summaries[j][..., d_k:]
        states.append(m @ states[-1] + s)
    return states


def _allgather_forward(ctx, m, s, initial, group, initial_needs_grad):
    platform = get_platform()
    d_k = m.shape[-1]
    size, rank = platform.get_world_size(group), platform.get_rank(group)
    summary = platform.cat([m, s], dim=-1).unsqueeze(0).contiguous()
    gathered = platform.all_gather(summary, group, dim=0)
    states = _fold([gathered[j] for j in range(size)], initial, rank, d_k)
    ctx.gathered, ctx.states, ctx.group, ctx.rank, ctx.size = gathered, states, group, rank, size
    ctx.initial_needs_grad = initial_needs_grad
    # a new tensor, never an input returned as-is (multiplying: MindSpore's CPU backend has no Clone kernel)
    return states[-1] * 1 if rank == 0 else states[-1]


def _allgather_backward(ctx, grad):
    platform = get_platform()
    d_k = ctx.gathered.shape[-2]
    slots = [platform.zeros_like(ctx.gathered[0]) for _ in range(ctx.size)]
    grad = grad.contiguous()
    for j in range(ctx.rank - 1, -1, -1):
        incoming = ctx.states[j]
        slots[j] = platform.cat([grad @ incoming.transpose(-1, -2), grad], dim=-1)
        grad = ctx.gathered[j][..., :d_k].transpose(-1, -2) @ grad
    stacked = platform.cat([slot.unsqueeze(0) for slot in slots], dim=0).contiguous()
    mine = platform.reduce_scatter(stacked, ctx.group, dim=0, op="sum")[0]
    grad_initial = None
    if ctx.initial_needs_grad:
        grad_initial = platform.all_reduce(grad.contiguous(), ctx.group, "sum")
    return mine[..., :d_k].contiguous(), mine[..., d_k:].contiguous(), grad_initial, None, None


_ALLGATHER = lazy_autograd_function("DeltaRuleStateAllGather", _allgather_forward, _allgather_backward)


def _neighbours(group):
    platform = get_platform()
    ranks = list(platform.group_ranks(group))
    rank = platform.get_rank(group)
    prev = ranks[rank - 1] if rank > 0 else None
    nxt = ranks[rank + 1] if rank + 1 < len(ranks) else None
    return prev, nxt


def _p2p_forward(ctx, m, s, initial, group, initial_needs_grad):
    platform = get_platform()
    prev, nxt = _neighbours(group)
    incoming = initial
    if prev is not None:    # wait for the state the ranks before hand on
        (incoming,) = platform.p2p_exchange([], [(initial, prev)], group)
    if nxt is not None:
        platform.p2p_exchange([((m @ incoming + s).contiguous(), nxt)], [], group)
    ctx.m, ctx.incoming, ctx.prev, ctx.nxt, ctx.group = m, incoming, prev, nxt, group
    ctx.initial_needs_grad = initial_needs_grad
    return incoming * 1 if prev is None else incoming   # a new tensor (see _allgather_forward)


def _p2p_backward(ctx, grad):
    platform = get_platform()
    grad = grad.contiguous()
    grad_m, grad_s = platform.zeros_like(ctx.m), platform.zeros_like(ctx.incoming)
    if ctx.nxt is not None:   # the gradient of the state this rank handed on
        (grad_out,) = platform.p2p_exchange([], [(grad, ctx.nxt)], ctx.group)
        grad_m, grad_s = grad_out @ ctx.incoming.transpose(-1, -2), grad_out
        grad = grad + ctx.m.transpose(-1, -2) @ grad_out
    grad_initial = None
    if ctx.prev is not None:
        platform.p2p_exchange([(grad.contiguous(), ctx.prev)], [], ctx.group)
        grad = platform.zeros_like(grad)   # rank 0 holds the initial state's whole gradient
    if ctx.initial_needs_grad:
        grad_initial = platform.all_reduce(grad.contiguous(), ctx.group, "sum")
    return grad_m.contiguous(), grad_s.contiguous(), grad_initial, None, None


_P2P = lazy_autograd_function("DeltaRuleStateRelay", _p2p_forward, _p2p_backward)

MODES = {"allgather": _ALLGATHER, "p2p": _P2P}


def incoming_state(mode: Any, m: Any, s: Any, initial: Any, group: Any) -> Any:
    """The state entering this rank's block (differentiable in m, s and ``initial``)."""
    needs = get_platform().requires_grad(initial)
    return MODES[mode](m, s, initial, group, needs)
