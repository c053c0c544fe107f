"""What ``chunked_cross_entropy`` checks before any data moves, and the vocab shard of its weight.

Every check reads only arguments every rank of the TP group holds alike (shapes, the placements,
the labels), so a bad call raises the same ``ValueError`` on every rank before the first all-reduce;
that they really are alike is checked first (``agree_across_vocab_shards``, core/agreement.py).
"""
from typing import Any
from hyper_parallel.core.dtensor.layout import chunk_range
from hyper_parallel.core.dtensor.placement_types import Shard
from hyper_parallel.platform import get_platform

REDUCTIONS = ("sum", "mean", "none")


def agree_across_vocab_shards(hidden: Any, weight: Any, labels: Any, chunk_size: Any, ignore_index: Any,
                              reduction: Any) -> None:
    """With a vocab-sharded weight, every rank of its TP group computes part of the same loss, so
    they must pass the same arguments, hidden of one shape and the same labels: a ValueError on
    every rank otherwise (core/agreement.py), before any per-rank check could raise alone. The
    arguments, shapes, dtypes and a digest of the labels' values (read to the host) are compared at
    the first call of each combination, and the digest again on every call under
    ``HP_CHECK_RANKS=every`` (labels change every step; a digest per step would be a host read per
    step). Only the TP dim: data-parallel ranks hold other labels legitimately."""
    from hyper_parallel.core.agreement import Deferred, check_agreement, tensor_digest
    placements: Any = getattr(weight, "placements", None)
    split = [m for m, p in enumerate(placements or ()) if p.is_shard()]
    if len(split) != 1:
        return   # a plain weight: no group; other layouts are refused (the same on every rank) later
    local = lambda x: x.to_local() if hasattr(x, "device_mesh") else x  # noqa: E731
    settings = {"chunk_size": chunk_size, "ignore_index": ignore_index, "reduction": reduction,
                "hidden": local(hidden), "labels": local(labels),
                "weight": (tuple(int(s) for s in weight.shape), tuple(str(p) for p in placements)),
                "labels values": Deferred(lambda: tensor_digest(local(labels)))}
    check_agreement(weight.device_mesh.get_group(split[0]), "chunked_cross_entropy", settings,
                    signature="vocab-parallel",
                    fix="every rank of the tensor-parallel group passes the same hidden states, labels and "
                        "options (the labels of the same tokens)")


def check_arguments(hidden: Any, weight: Any, labels: Any, chunk_size: Any, ignore_index: Any,
                    reduction: Any) -> None:
    who = "chunked_cross_entropy"
    agree_across_vocab_shards(hidden, weight, labels, chunk_size, ignore_index, reduction)
    if reduction not in REDUCTIONS:
        raise ValueError(f"{who}(reduction={reduction!r}): pass one of {REDUCTIONS}")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"{who}(chunk_size={chunk_size!r}): pass a positive int (tokens per tile: 1024)")
    if not isinstance(ignore_index, int) or isinstance(ignore_index, bool):
        raise ValueError(f"{who}(ignore_index={ignore_index!r}): pass an int (e.g. -100)")
    if len(weight.shape) != 2:
        raise ValueError(f"{who}: weight has shape {tuple(weight.shape)}; pass the (vocab, hidden) weight of "
                         f"the output projection (nn.Linear's weight)")
    if len(hidden.shape) < 1 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"{who}: hidden has shape {tuple(hidden.shape)} but weight {tuple(weight.shape)}; "
                         f"hidden's last dim must be the weight's dim 1 ({weight.shape[1]})")
    if tuple(labels.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(f"{who}: labels have shape {tuple(labels.shape)}, hidden {tuple(hidden.shape)}; "
                         f"pass "
                         f"one label per hidden vector (labels.shape == hidden.shape[:-1])")
    if get_platform().is_floating_point(labels):
        raise ValueError(f"{who}: labels have dtype {labels.dtype}; pass class indices (an integer tensor)")
    if hasattr(labels, "device_mesh"):
        raise ValueError(f"{who}: labels are a DTensor; pass this rank's labels as a plain tensor")
    if hasattr(hidden, "device_mesh") and any(not p.is_replicate() for p in hidden.placements):
        raise ValueError(f"{who}: hidden is a DTensor with placements {hidden.placements}; pass a replicated "
                         f"DTensor or this rank's hidden states as a plain tensor (a sequence shard is "
                         f"fine as a plain tensor with its own labels)")


def vocab_shard(weight: Any) -> Any:
    """(local weight, TP group or None, first vocab row held here, global vocab size)."""
    vocab = int(weight.shape[0])
    if not hasattr(weight, "device_mesh"):
        return weight, None, 0, vocab
    mesh, placements = weight.device_mesh, weight.placements
    split = [m for m, p in enumerate(placements) if p.is_shard()]
    others = [p for p in placements if not p.is_shard() and not p.is_replicate()]
    if others or len(split) > 1 or (split and placements[split[0]] != Shard(0)):
        raise ValueError(f"chunked_cross_entropy: the weight's placements {placements} are not supported; "
                         f"pass a weight sharded on its vocab dim on one mesh dim (Shard(0), e.g. "
                         f"ColwiseParallel's LM head) and replicated on the others, or a plain tensor")
    local = weight.to_local()
    if not split:
        return local, None, 0, vocab
    dim = split[0]
    start, _ = chunk_range(0, vocab, mesh.size(dim), mesh.get_local_rank(dim))
    return local, mesh.get_group(dim), start, vocab


def check_labels(labels: Any, vocab: Any, ignore_index: Any) -> None:
    """Labels outside [0, vocab) other than ``ignore_index`` would silently add a wrong loss."""
    bad = ((labels < 0) | (labels >= vocab)) & (labels != ignore_index)
    if not get_platform().is_fake(bad) and bool(bad.any()):   # a dry run has no label values
        first = labels[bad][0]
        raise ValueError(f"chunked_cross_entropy: label {int(first)} is outside [0, {vocab}) and not "
                         f"ignore_index={ignore_index}; fix the labels or pass ignore_index={int(first)}")
