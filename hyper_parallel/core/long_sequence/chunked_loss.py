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
from typing import Any
import inspect
import math

from hyper_parallel.core.autograd_functions import lazy_autograd_function
from hyper_parallel.core.long_sequence.loss_checks import check_arguments, check_labels, vocab_shard
from hyper_parallel.core.typing import Tensor
from hyper_parallel.platform import get_platform

__all__ = ["chunked_cross_entropy"]

DEFAULT_CHUNK = 1024


class _Plan:
    """What the autograd function needs beside the tensors (not differentiable)."""
    __slots__ = ("chunk", "ignore_index", "reduction", "group", "vocab_start")

    def __init__(self, chunk, ignore_index, reduction, group, vocab_start):
        self.chunk, self.ignore_index, self.reduction = chunk, ignore_index, reduction
        self.group, self.vocab_start = group, vocab_start


_OPTIONS = ("chunk_size", "ignore_index", "reduction", "class_weight")


def chunked_cross_entropy(hidden: Tensor, *args: Any, **kwargs: Any) -> Tensor:
    """``F.cross_entropy(hidden @ weight.T, labels, weight=class_weight, ignore_index=, reduction=)``
    without the logits: ``chunked_cross_entropy(hidden, weight, labels, *, chunk_size=1024,
    ignore_index=-100, reduction="sum", class_weight=None)``.

    ``hidden`` (..., H), ``weight`` (V, H) — or a DTensor sharded on its vocab dim (``Shard(0)``, the
    rest replicated) — and integer ``labels`` (...) of hidden's leading shape. ``reduction``: "sum",
    "mean" (over the tokens whose label is not ``ignore_index``, weighted by ``class_weight`` as
    torch does) or "none" (labels' shape, 0 at ignored tokens). ``class_weight``: a plain (V,) tensor
    of per-class weights, F.cross_entropy's ``weight`` (here ``weight`` is the output projection).
    Memory beyond the inputs: O(chunk_size × local vocab). Values and gradients equal the plain
    path's up to the order of floating-point sums."""
    if "weight" in kwargs and len(args) >= 1:
        raise ValueError("chunked_cross_entropy(weight=...): weight is the output projection's (vocab, "
                         "hidden) weight, already given positionally; pass per-class weights "
                         "(F.cross_entropy's weight=) as class_weight=")
    unknown = sorted(set(kwargs) - set(_OPTIONS) - {"weight", "labels"})
    if unknown or len(args) > 2:
        what = ", ".join(unknown) if unknown else f"{len(args) + 1} positional arguments"
        raise ValueError(f"chunked_cross_entropy: {what} not supported; it takes (hidden, weight, labels, *, "
                         f"{', '.join(_OPTIONS)})")
    return _chunked_cross_entropy(hidden, *args, **kwargs)


def _chunked_cross_entropy(hidden, weight, labels, *, chunk_size=DEFAULT_CHUNK, ignore_index=-100,
                           reduction="sum", class_weight=None):
    check_arguments(hidden, weight, labels, chunk_size, ignore_index, reduction)
    weight_local, group, vocab_start, vocab = vocab_shard(weight)
    _check_class_weight(class_weight, vocab)
    hidden_local = hidden.to_local() if hasattr(hidden, "device_mesh") else hidden
    lead = tuple(labels.shape)
    flat_hidden = hidden_local.reshape(-1, hidden_local.shape[-1])
    flat_labels = labels.reshape(-1)
    check_labels(flat_labels, vocab, ignore_index)      # every rank holds the same labels: all raise
    plan = _Plan(int(chunk_size), ignore_index, reduction, group, vocab_start)
    token_weights = _token_weights(flat_labels, class_weight, ignore_index, flat_hidden)
    out = _CHUNKED_CE(flat_hidden, weight_local, flat_labels, token_weights, plan)
    return out.reshape(lead) if reduction == "none" else out


# help() and IDEs show the real arguments; the public function takes *args only to name mistakes
chunked_cross_entropy.__signature__ = inspect.signature(_chunked_cross_entropy)  # type: ignore[attr-defined]


def _check_class_weight(class_weight, vocab):
    if class_weight is None:
        return
    platform = get_platform()
    if hasattr(class_weight, "device_mesh") or not platform.is_tensor(class_weight):
        raise ValueError(f"chunked_cross_entropy(class_weight={type(class_weight).__name__}): pass a plain "
                         f"tensor of {vocab} per-class weights (the same on every rank), or None")
    if tuple(class_weight.shape) != (vocab,) or not platform.is_floating_point(class_weight):
        raise ValueError(f"chunked_cross_entropy: class_weight has shape {tuple(class_weight.shape)} and "
                         f"dtype {class_weight.dtype}; pass a floating ({vocab},) tensor, a weight per class")
    if getattr(class_weight, "requires_grad", False):
        raise ValueError("chunked_cross_entropy: class_weight requires grad; its gradient is not computed "
                         "(as F.cross_entropy); pass class_weight.detach()")


def _token_weights(labels, class_weight, ignore_index, hidden):
    """Each token's weight in the loss: 0 where ignored, else 1 or its class's weight."""
    platform = get_platform()
    dtype = platform.compute_dtype(hidden.dtype)
    valid = (labels != ignore_index).to(dtype)
    if class_weight is None:
        return valid
    # an ignored label may be out of range: look up class 0 there, the 0 of ``valid`` removes it
    safe = labels.masked_fill(labels == ignore_index, 0)
    return class_weight.to(dtype).index_select(0, safe) * valid


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


def _row_max(logits, platform):
    """Each row's largest local logit; -inf on a rank the vocab split left no rows (V < TP size), so
    the all-reduce of the maxima sees only the other ranks'."""
    if logits.shape[-1] == 0:
        return platform.zeros((logits.shape[0], 1), dtype=logits.dtype, device=logits.device) - math.inf
    return logits.max(dim=-1, keepdim=True)[0]


def _target_logit(logits, labels, start, end, plan):
    """The target's (shifted) logit of each row, 0 where another rank holds the target column."""
    vocab_local = logits.shape[-1]
    if vocab_local == 0:
        return get_platform().zeros((logits.shape[0], 1), dtype=logits.dtype, device=logits.device)
    column, here = _targets(labels, start, end, plan, vocab_local)
    return logits.gather(dim=-1, index=column.unsqueeze(1)) * here.unsqueeze(1).to(logits.dtype)


def _forward(ctx, hidden, weight, labels, token_weights, plan):
    platform = get_platform()
    dtype = platform.compute_dtype(hidden.dtype)
    lse_tiles, loss_tiles = [], []
    for start, end in _tiles(hidden.shape[0], plan.chunk):
        # one (tile x vocab) tensor, updated in place: the tile is the only big allocation
        logits = _tile_logits(hidden, weight, start, end, dtype)
        row_max = _row_max(logits, platform)
        if plan.group is not None:
            row_max = platform.all_reduce(row_max, plan.group, op="max")
        logits = logits.sub_(row_max)     # the result, not the side effect: MindSpore may return a new tensor
        target = _target_logit(logits, labels, start, end, plan)
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
    losses = losses.masked_fill(valid.logical_not(), 0.0) * token_weights
    count = token_weights.sum()     # the tokens counted (weighted by their classes, as torch's mean)
    ctx.save_for_backward(hidden, weight, labels, lse, token_weights, count)
    ctx.plan = plan
    if plan.reduction == "none":
        return losses.to(hidden.dtype)
    total = losses.sum()
    return (total if plan.reduction == "sum" else total / count).to(hidden.dtype)


def _token_grads(grad, token_weights, count, plan, dtype):
    """d loss / d (each token's unweighted loss), 0 at ignored tokens, as a (tokens, 1) column."""
    grad = grad.to(dtype)
    if plan.reduction == "mean":
        grad = grad / count
    per_token = grad * token_weights   # broadcasts a scalar, multiplies "none"
    return per_token.reshape(-1, 1)


def _backward(ctx, grad):
    # d loss / d logits = (softmax - one_hot) * token_grad; the softmax part is contracted tile by
    # tile, the one-hot part is a row lookup (hidden) and a row scatter (weight): no one-hot tile
    platform = get_platform()
    hidden, weight, labels, lse, token_weights, count = ctx.saved_tensors
    plan = ctx.plan
    dtype = platform.compute_dtype(hidden.dtype)
    vocab_local = weight.shape[0]
    token_grad = _token_grads(grad, token_weights, count, plan, dtype)
    weight_c, hidden_c = weight.to(dtype), hidden.to(dtype)
    grad_weight = platform.zeros(tuple(weight.shape), dtype=dtype, device=weight.device)
    hidden_tiles, columns, target_grads = [], [], []
    for start, end in _tiles(hidden.shape[0], plan.chunk):
        probs = _tile_logits(hidden, weight, start, end, dtype)
        probs = probs.sub_(lse[start:end].unsqueeze(1)).exp_().mul_(token_grad[start:end])
        tile_grad = probs @ weight_c
        if vocab_local:    # an empty vocab shard holds no target column: no one-hot part here
            column, here = _targets(labels, start, end, plan, vocab_local)
            target_grad = token_grad[start:end] * here.unsqueeze(1).to(dtype)
            tile_grad = tile_grad - target_grad * weight_c.index_select(0, column)
            columns.append(column)
            target_grads.append(target_grad)
        hidden_tiles.append(tile_grad)
        grad_weight += probs.transpose(0, 1) @ hidden_c[start:end]
    if columns:
        grad_weight = platform.add_rows(grad_weight, platform.cat(columns, dim=0),
                                        -(platform.cat(target_grads, dim=0) * hidden_c))
    grad_hidden = platform.cat(hidden_tiles, dim=0) if hidden_tiles else platform.zeros_like(hidden)
    if plan.group is not None:   # each rank's share comes from its vocab columns only
        grad_hidden = platform.all_reduce(grad_hidden, plan.group, op="sum")
    return grad_hidden.to(hidden.dtype), grad_weight.to(weight.dtype), None, None, None


_CHUNKED_CE = lazy_autograd_function("ChunkedCrossEntropy", _forward, _backward)
