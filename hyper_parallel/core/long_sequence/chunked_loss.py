"""``chunked_cross_entropy``: the output projection and the cross-entropy in sequence tiles.

The logits of a long sequence are tokens × vocab (128k × 128k is 32 GB in bf16), far larger than
anything else the loss needs. Here one autograd function runs the projection tile by tile:
forward keeps only each token's log-sum-exp (one float a token); backward recomputes each tile's
logits from the saved hidden states and weight, turns them into the gradient of the logits
(softmax − one-hot) and contracts it straight away into the gradients of hidden and weight. At no
point does more than one (chunk × vocab) tile exist, forward or backward.

With a vocab-parallel weight (a DTensor ``Shard(0)`` on a TP mesh dim: the weight of a
ColwiseParallel LM head) each rank computes its vocab columns only; per tile, one all-reduce of
the row maxima and one of (sum of exponentials, target logit) — a few numbers a token — give the
global log-sum-exp; the gradient of hidden (each rank's share from its columns) is all-reduced
once at the end of backward, the weight's gradient stays a local shard.
"""
from hyper_parallel.core.autograd_functions import lazy_autograd_function
from hyper_parallel.core.long_sequence.loss_checks import check_arguments, check_labels, vocab_shard
from hyper_parallel.platform import get_platform

__all__ = ["chunked_cross_entropy"]

DEFAULT_CHUNK = 1024


class _Plan:
    """What the autograd function needs beside the tensors (not differentiable)."""
    __slots__ = ("chunk", "ignore_index", "reduction", "group", "vocab_start")

    def __init__(self, chunk, ignore_index, reduction, group, vocab_start):
        self.chunk, self.ignore_index, self.reduction = chunk, ignore_index, reduction
        self.group, self.vocab_start = group, vocab_start


def chunked_cross_entropy(hidden, weight, labels, *, chunk_size=DEFAULT_CHUNK, ignore_index=-100,
                          reduction="sum"):
    """``F.cross_entropy(hidden @ weight.T, labels, ignore_index=, reduction=)`` without the logits.

    ``hidden`` (..., H), ``weight`` (V, H) — or a DTensor sharded on its vocab dim (``Shard(0)``, the
    rest replicated) — and integer ``labels`` (...) of hidden's leading shape. ``reduction``: "sum",
    "mean" (over the tokens whose label is not ``ignore_index``) or "none" (labels' shape, 0 at
    ignored tokens). Memory beyond the inputs: O(chunk_size × local vocab). Values and gradients
    equal the plain path's up to the order of floating-point sums."""
    check_arguments(hidden, weight, labels, chunk_size, ignore_index, reduction)
    weight_local, group, vocab_start, vocab = vocab_shard(weight)
    hidden_local = hidden.to_local() if hasattr(hidden, "device_mesh") else hidden
    lead = tuple(labels.shape)
    flat_hidden = hidden_local.reshape(-1, hidden_local.shape[-1])
    flat_labels = labels.reshape(-1)
    check_labels(flat_labels, vocab, ignore_index)      # every rank holds the same labels: all raise
    plan = _Plan(int(chunk_size), ignore_index, reduction, group, vocab_start)
    out = _CHUNKED_CE(flat_hidden, weight_local, flat_labels, plan)
    return out.reshape(lead) if reduction == "none" else out


def _tiles(n, chunk):
    return [(s, min(s + chunk, n)) for s in range(0, n, chunk)]


def _tile_logits(hidden, weight, start, end, dtype):
    """One tile's (local-vocab) logits in the compute dtype."""
    return (hidden[start:end] @ weight.transpose(0, 1)).to(dtype)


def _targets(labels, start, end, plan, vocab_local):
    """(column of each row's target in this rank's vocab slice, clamped; 1.0 where this rank holds it)."""
    local = labels[start:end] - plan.vocab_start
    here = (local >= 0) & (local < vocab_local)
    return local.clamp(0, vocab_local - 1), here


def _forward(ctx, hidden, weight, labels, plan):
    platform = get_platform()
    dtype = platform.compute_dtype(hidden.dtype)
    n, vocab_local = hidden.shape[0], weight.shape[0]
    lse_tiles, loss_tiles = [], []
    for start, end in _tiles(n, plan.chunk):
        # one (tile x vocab) tensor, updated in place: the tile is the only big allocation
        logits = _tile_logits(hidden, weight, start, end, dtype)
        row_max = logits.max(dim=-1, keepdim=True)[0]
        if plan.group is not None:
            row_max = platform.all_reduce(row_max, plan.group, op="max")
        logits = logits.sub_(row_max)     # the result, not the side effect: MindSpore may return a new tensor
        column, here = _targets(labels, start, end, plan, vocab_local)
        # the target's shifted logit, 0 on ranks that do not hold the target column
        target = logits.gather(dim=-1, index=column.unsqueeze(1)) * here.unsqueeze(1).to(dtype)
        sum_exp = logits.exp_().sum(dim=-1, keepdim=True)
        if plan.group is not None:   # one all-reduce for both: a pair of floats a token
            pair = platform.all_reduce(platform.cat([sum_exp, target], dim=-1), plan.group, op="sum")
            sum_exp, target = pair[:, 0:1], pair[:, 1:2]
        log_sum = sum_exp.log()
        lse_tiles.append((row_max + log_sum).reshape(-1))
        loss_tiles.append((log_sum - target).reshape(-1))
    valid = labels != plan.ignore_index
    empty = platform.zeros((0,), dtype=dtype, device=hidden.device)
    lse = platform.cat(lse_tiles, dim=0) if lse_tiles else empty
    losses = platform.cat(loss_tiles, dim=0) if loss_tiles else empty
    losses = losses.masked_fill(valid.logical_not(), 0.0)
    count = valid.sum()
    ctx.save_for_backward(hidden, weight, labels, lse, count)
    ctx.plan = plan
    if plan.reduction == "none":
        return losses.to(hidden.dtype)
    total = losses.sum()
    return (total if plan.reduction == "sum" else total / count.to(dtype)).to(hidden.dtype)


def _token_grads(grad, labels, count, plan, dtype):
    """d loss / d (each token's loss), 0 at ignored tokens, as a (tokens, 1) column."""
    grad = grad.to(dtype)
    if plan.reduction == "mean":
        grad = grad / count.to(dtype)
    per_token = grad * (labels != plan.ignore_index).to(dtype)   # broadcasts a scalar, multiplies "none"
    return per_token.reshape(-1, 1)


def _backward(ctx, grad):
    # d loss / d logits = (softmax - one_hot) * token_grad; the softmax part is contracted tile by
    # tile, the one-hot part is a row lookup (hidden) and a row scatter (weight): no one-hot tile
    platform = get_platform()
    hidden, weight, labels, lse, count = ctx.saved_tensors
    plan = ctx.plan
    dtype = platform.compute_dtype(hidden.dtype)
    vocab_local = weight.shape[0]
    token_grad = _token_grads(grad, labels, count, plan, dtype)
    weight_c, hidden_c = weight.to(dtype), hidden.to(dtype)
    grad_weight = platform.zeros(tuple(weight.shape), dtype=dtype, device=weight.device)
    hidden_tiles, columns, target_grads = [], [], []
    for start, end in _tiles(hidden.shape[0], plan.chunk):
        probs = _tile_logits(hidden, weight, start, end, dtype)
        probs = probs.sub_(lse[start:end].unsqueeze(1)).exp_().mul_(token_grad[start:end])
        column, here = _targets(labels, start, end, plan, vocab_local)
        target_grad = token_grad[start:end] * here.unsqueeze(1).to(dtype)
        hidden_tiles.append(probs @ weight_c - target_grad * weight_c.index_select(0, column))
        grad_weight += probs.transpose(0, 1) @ hidden_c[start:end]
        columns.append(column)
        target_grads.append(target_grad)
    if columns:
        grad_weight = platform.add_rows(grad_weight, platform.cat(columns, dim=0),
                                        -(platform.cat(target_grads, dim=0) * hidden_c))
    grad_hidden = platform.cat(hidden_tiles, dim=0) if hidden_tiles else platform.zeros_like(hidden)
    if plan.group is not None:   # each rank's share comes from its vocab columns only
        grad_hidden = platform.all_reduce(grad_hidden, plan.group, op="sum")
    return grad_hidden.to(hidden.dtype), grad_weight.to(weight.dtype), None, None


_CHUNKED_CE = lazy_autograd_function("ChunkedCrossEntropy", _forward, _backward)
