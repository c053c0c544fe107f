"""Dropless token dispatch of an expert-parallel MoE layer (docs/expert_parallel.md).

Each rank routes its own tokens. One call:

1. the (token, k) assignments are sorted by expert (host, stable): rows for rank d's experts are
   contiguous, ordered by expert inside;
2. the per-expert counts are exchanged (``all_to_all_single`` of E + ep int64 per rank: each block
   carries a flag for router indices out of range, so every rank raises together): every rank
   learns how many rows it receives from each source for each of its E / ep experts;
3. ONE all-to-all of variable splits sends the rows to their experts' ranks (``VariableAllToAll``:
   its backward is the reverse variable all-to-all on a contiguous gradient);
4. the received rows are regrouped by local expert and computed (``compute``);
5. the reverse all-to-all returns them; the caller's rank weights them by the router's scores and
   sums over k. Weighting after the return keeps the scores' gradient on the token's own rank.

Assignments to expert index ``E`` (Hugging Face's "no expert" slot) are dropped (zero output).
"""
import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence, Tuple

import numpy as np

from hyper_parallel.core.autograd_functions import lazy_autograd_function
from hyper_parallel.platform import get_platform


def host_ints(tensor: Any) -> np.ndarray:
    """An integer tensor's values as a host int64 array (torch or MindSpore)."""
    if hasattr(tensor, "asnumpy"):
        return np.asarray(tensor.asnumpy(), dtype=np.int64)
    return np.asarray(tensor.detach().cpu().numpy(), dtype=np.int64)


def _exchange(tensor: Any, group: Any, send: Sequence[int], recv: Sequence[int]) -> Any:
    """Rows ``[sum(send[:d]), sum(send[:d+1]))`` go to group rank d; rank s's rows arrive in order."""
    platform = get_platform()
    pieces, start = [], 0
    for rows in send:
        pieces.append(tensor[start:start + rows])
        start += rows
    tail = tuple(tensor.shape[1:])
    received = platform.all_to_all(pieces, group, [(rows,) + tail for rows in recv])
    return platform.cat(list(received), 0)


def _a2a_forward(ctx: Any, tensor: Any, group: Any, send: tuple, recv: tuple) -> Any:
    ctx.group, ctx.send, ctx.recv = group, send, recv
    return _exchange(tensor, group, send, recv)


def _a2a_backward(ctx: Any, grad: Any) -> tuple:
    # the reverse exchange: every row's gradient returns to the rank that sent the row
    return _exchange(grad.contiguous(), ctx.group, ctx.recv, ctx.send), None, None, None


VariableAllToAll = lazy_autograd_function("VariableAllToAll", _a2a_forward, _a2a_backward)


def _scale_forward(ctx: Any, tensor: Any, scale: float) -> Any:
    ctx.scale = scale
    return tensor.view(tuple(tensor.shape))


def _scale_backward(ctx: Any, grad: Any) -> tuple:
    return grad * ctx.scale, None


# identity forward, gradient times ``scale``: an expert's gradient arrives summed over every ep
# rank's loss, and data parallelism averages the other parameters' gradients over those ranks
GradScale = lazy_autograd_function("ExpertGradScale", _scale_forward, _scale_backward)


@dataclass(frozen=True)
class RoutingPlan:
    """Host bookkeeping of one dispatch (every index a platform int64 tensor)."""
    token_rows: Any            # (n_sent,) the token of each sorted row
    back: Any                  # (T*K,) row of [returned rows; a zero row] for each assignment
    dropped: bool                 # some assignment chose the "no expert" slot
    send: Tuple[int, ...]         # rows sent to each group rank
    recv: Tuple[int, ...]         # rows received from each group rank
    regroup: Any               # (n_recv,) received rows ordered by local expert
    ungroup: Any               # its inverse
    expert_rows: Tuple[int, ...]  # rows of each local expert after regrouping
    counts: np.ndarray            # (E,) this rank's assignments per expert
    recv_counts: np.ndarray       # (ep, E / ep) rows from each source for each local expert


def _inverse(perm: np.ndarray) -> np.ndarray:
    inverse = np.empty_like(perm)
    inverse[perm] = np.arange(perm.size, dtype=perm.dtype)
    return inverse


def plan_routing(top_k_index: Any, num_experts: int, group: Any, ep: int,
                 device: Any) -> RoutingPlan:
    """Sort this rank's assignments by expert and exchange the counts (one small all-to-all)."""
    platform = get_platform()
    top_k = int(top_k_index.shape[-1]) if len(top_k_index.shape) else 1
    fake = platform.is_fake(top_k_index)
    # a dry run (hyper_parallel.plan) has no router values: it assumes balanced routing, assignment i
    # (token i // k, choice i % k) to expert i mod E, the same on every rank
    flat = (np.arange(math.prod(top_k_index.shape), dtype=np.int64) % num_experts if fake
            else host_ints(top_k_index).reshape(-1))
    # an index outside [0, E] travels as a flag with the counts, so every rank raises (none waits)
    bad = int(flat.size > 0 and (flat.min() < 0 or flat.max() > num_experts))
    if bad:
        flat = np.zeros_like(flat)
    order = np.argsort(flat, kind="stable")
    counts = np.bincount(flat, minlength=num_experts + 1)[:num_experts].astype(np.int64)
    n_sent = int(counts.sum())
    local = num_experts // ep
    table = np.concatenate([counts.reshape(ep, local), np.full((ep, 1), bad, dtype=np.int64)], 1)
    received = platform.all_to_all_single(platform.tensor(table, device=device), group)
    # dry run: every source routes alike, so each sends this rank the block for this rank's experts
    received = (np.tile(table[platform.get_rank(group)], (ep, 1)) if platform.is_fake(received)
                else host_ints(received))
    received = received.reshape(ep, local + 1)
    if received[:, -1].any():
        raise ValueError(f"ExpertParallel: router indices outside [0, {num_experts}] ({num_experts} = no "
                         f"expert) on group rank(s) {np.flatnonzero(received[:, -1]).tolist()}")
    recv_counts = received[:, :local]
    # received rows come by source, then by expert: a stable sort on the expert regroups them
    row_expert = np.repeat(np.tile(np.arange(local), ep), recv_counts.reshape(-1))
    regroup = np.argsort(row_expert, kind="stable")
    position = _inverse(order)
    back = np.minimum(position, n_sent)     # dropped assignments read the zero row
    as_index = (lambda a: platform.tensor(a.astype(np.int64), device=device))
    return RoutingPlan(
        token_rows=as_index(order[:n_sent] // max(top_k, 1)), back=as_index(back),
        dropped=n_sent < flat.size, send=tuple(int(v) for v in counts.reshape(ep, local).sum(1)),
        recv=tuple(int(v) for v in recv_counts.sum(1)), regroup=as_index(regroup),
        ungroup=as_index(_inverse(regroup)), expert_rows=tuple(int(v) for v in recv_counts.sum(0)),
        counts=counts, recv_counts=recv_counts)


def dispatch_combine(hidden: Any, top_k_index: Any, top_k_weights: Any, num_experts: int,
                     group: Any, ep: int, compute: Callable[[Any, Tuple[int, ...]], Any]) -> Any:
    """``sum_k weight[t, k] * expert_{index[t, k]}(hidden[t])`` for this rank's tokens, the experts
    living on their ranks. ``compute(rows, expert_rows)`` runs the local experts on rows grouped by
    expert (``expert_rows[j]`` rows for local expert j) and returns one output row per input row."""
    platform = get_platform()
    plan = plan_routing(top_k_index, num_experts, group, ep, hidden.device)
    sent = hidden[plan.token_rows]
    received = VariableAllToAll(sent, group, plan.send, plan.recv)
    out = compute(received[plan.regroup], plan.expert_rows)[plan.ungroup]
    returned = VariableAllToAll(out.contiguous(), group, plan.recv, plan.send)
    if plan.dropped:
        zero = platform.zeros((1,) + tuple(returned.shape[1:]), dtype=returned.dtype, device=returned.device)
        returned = platform.cat([returned, zero], 0)
    tokens, top_k = int(top_k_index.shape[0]), int(top_k_index.shape[-1])
    per_choice = returned[plan.back].reshape(tokens, top_k, -1)
    weighted = per_choice * top_k_weights.reshape(tokens, top_k, 1).to(per_choice.dtype)
    return weighted.sum(1).to(hidden.dtype)
