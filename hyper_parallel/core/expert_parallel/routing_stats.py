"""Router statistics and the load-balancing loss over the GLOBAL tokens.

The Switch-Transformer loss ``E · Σ_e f_e · P_e`` (f_e: share of top-k assignments to expert e,
P_e: mean router probability of e) is a product of two means, so the mean of per-rank losses is not
the loss of the global batch. Here the per-expert assignment counts, probability sums and token
counts are all-reduced over the data ranks (one all-reduce of 2E + 1 numbers for the statistics,
one differentiable all-reduce of the E probability sums whose backward sums the gradients: every
rank's loss carries the same global term, and data parallelism averages over the same ranks).
The result equals Hugging Face's ``load_balancing_loss_func`` on the whole batch in one process.
"""
from typing import Any, Optional, Sequence, Tuple

from hyper_parallel.platform import get_platform


def _layer_sums(logits: Any, num_experts: int, top_k: int, mask: Optional[Any]) -> Tuple:
    probs = logits.float().softmax(-1)
    chosen = probs.topk(top_k, dim=-1)[1]
    platform = get_platform()
    weight = platform.create_tensor("ones", tuple(chosen.shape), dtype=probs.dtype, device=probs.device)
    if mask is not None:
        weight = weight * mask.reshape(-1, 1).to(probs.dtype)
        probs = probs * mask.reshape(-1, 1).to(probs.dtype)
    counts = platform.zeros((num_experts,), dtype=probs.dtype, device=probs.device)
    counts = counts.scatter_add(0, chosen.reshape(-1), weight.reshape(-1))
    rows = weight[:, 0].sum()
    return counts, probs.sum(0), rows


def global_routing_sums(router_logits: Sequence[Any], num_experts: int, top_k: int, group: Any,
                        attention_mask: Optional[Any] = None) -> Tuple[Any, Any, Any]:
    """(assignments per expert, router-probability sums per expert, token count), each summed over
    every layer's logits and every rank of ``group``; the probability sums keep their gradient."""
    platform = get_platform()
    sums = [_layer_sums(logits, num_experts, top_k, attention_mask) for logits in router_logits]
    counts, probs, rows = (sum(column[1:], column[0]) for column in zip(*sums))
    stats = platform.cat([counts.detach(), rows.detach().reshape(1)], 0)
    stats = platform.all_reduce(stats.contiguous(), group, "sum", tag="expert_routing_stats")
    probs = platform.differentiable_all_reduce(probs.contiguous(), group, "sum", backward="sum")
    return stats[:num_experts], probs, stats[num_experts]


def load_balancing_loss(router_logits: Sequence[Any], num_experts: int, top_k: int, group: Any,
                        attention_mask: Optional[Any] = None) -> Any:
    """Hugging Face's ``load_balancing_loss_func`` over the global batch of ``group``'s ranks
    (``attention_mask``: this rank's, flattened like the logits' rows)."""
    if not router_logits:
        raise ValueError("load_balancing_loss: no router logits (the model has no MoE layer?)")
    counts, probs, rows = global_routing_sums(router_logits, num_experts, top_k, group, attention_mask)
    return (counts / rows * (probs / rows)).sum() * num_experts


def token_imbalance(counts: Sequence[int], ep: int) -> float:
    """max / mean of the rows each ep rank's experts receive, from per-expert counts (1.0 = balanced)."""
    per_rank = [sum(counts[r * len(counts) // ep:(r + 1) * len(counts) // ep]) for r in range(ep)]
    mean = sum(per_rank) / ep
    return max(per_rank) / mean if mean else 1.0
