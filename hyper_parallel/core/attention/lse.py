"""Log-sum-exp algebra of partial attentions: merging two over disjoint keys, rows that saw no key,
and attention sinks.

A partial result is (out, lse): out (batch, heads, seq, dim) normalised over its keys, lse
(batch, heads, seq) their log-sum-exp. A row that saw no key is (0, -inf). A sink (gpt-oss's
``s_aux``: one learned logit σ_h per head in the softmax denominator, no value) is a key of logit
σ_h and value 0, so it is merged like one more block: lse' = log(e^lse + e^σ), out' = out·e^(lse -
lse'). The gradients of q, k, v are then those of the blocks computed with the final (out', lse')
(the sink adds nothing else to them); the sink's own gradient is its score gradient p·(dp - Δ) with
dp = 0 (value 0): dσ_h = -Σ over batch and rows of e^(σ_h - lse')·(dO·O').
"""
from typing import Any

NEG_INF = float("-inf")


def merge(acc: Any, out: Any, lse: Any) -> Any:
    """Two partial attentions over disjoint keys; rows where both saw nothing stay (0, -inf)."""
    out = out.to(lse.dtype)
    if acc is None:
        return out, lse
    acc_out, acc_lse = acc
    # log(e^a + e^b) by hand, shifted by the larger: logaddexp(-inf, -inf) is NaN on MindSpore
    top = acc_lse.maximum(lse)
    dead = top == NEG_INF
    shift = top.masked_fill(dead, 0.0)
    new = ((acc_lse - shift).exp() + (lse - shift).exp()).log() + shift
    w_acc = (acc_lse - new).exp().masked_fill(dead, 0.0).unsqueeze(-1)
    w_new = (lse - new).exp().masked_fill(dead, 0.0).unsqueeze(-1)
    return acc_out * w_acc + out * w_new, new


def clear_empty_rows(out: Any, lse: Any, mask: Any) -> Any:
    """A block kernel's result with the rows its boolean ``mask`` left without a key set to
    (0, -inf) (the fused kernels leave such rows unspecified)."""
    empty = ~mask.any(-1)
    return out.masked_fill(empty.unsqueeze(-1), 0.0), lse.masked_fill(empty, NEG_INF)


def _per_head(sinks, lse):
    return sinks.to(lse.dtype).reshape((1, -1, 1))


def fold_sinks(out: Any, lse: Any, sinks: Any) -> Any:
    """(out', lse') with the per-head sink logits ``sinks`` (this block's heads) in the denominator."""
    sink = _per_head(sinks, lse)
    top = lse.maximum(sink)   # finite: the sink logits are
    new = ((lse - top).exp() + (sink - top).exp()).log() + top
    return out.to(lse.dtype) * (lse - new).exp().unsqueeze(-1), new


def sinks_grad(grad_out: Any, out: Any, lse: Any, sinks: Any) -> Any:
    """dσ of the rows held here (summed over batch and rows), from the folded (out', lse')."""
    delta = (grad_out.to(lse.dtype) * out.to(lse.dtype)).sum(-1)
    weight = (_per_head(sinks, lse) - lse).exp()
    return -(weight * delta).sum(0).sum(-1).to(sinks.dtype)


def merge_blocks(acc: Any, out: Any, lse: Any) -> Any:
    """Combine two partial attentions over disjoint keys by their log-sum-exp."""
    if acc is None:
        return out.to(lse.dtype), lse
    acc_out, acc_lse = acc
    new_lse = acc_lse.logaddexp(lse)
    merged = (acc_out * (acc_lse - new_lse).exp().unsqueeze(-1)
              + out.to(lse.dtype) * (lse - new_lse).exp().unsqueeze(-1))
    return merged, new_lse


__all__ = ["NEG_INF", "clear_empty_rows", "fold_sinks", "merge", "merge_blocks", "sinks_grad"]
