"""The aten forms of embedding: ``embedding(weight, indices, padding_idx=-1, scale_grad_by_freq,
sparse)`` (what ``torch.embedding`` and F.embedding calls the user-level rule leaves reach) and its
gradient ``embedding_dense_backward(grad_output, indices, num_weights, padding_idx,
scale_grad_by_freq)``. (The user-level rule, vocab-parallel lookup included: embedding.py.)

Forward, per mesh dim, by the weight's placement: Replicate -> the output follows the indices' shard
(a lookup per index); Shard(1) -> indices replicated, output Shard(last); anything else (a vocab
split, a Partial weight) -> the weight is replicated. Partial indices (integers) are replicated.

Backward: grad_weight[v] sums grad_output rows over the positions whose index is v. Where grad_output
and indices are split alike on a position dim, each rank sums its own positions: Partial(sum).
grad_output split on its last (embedding) dim gives grad_weight Shard(1). ``scale_grad_by_freq``
divides by counts over every position, so the positions are gathered then.
"""
from typing import Any
from hyper_parallel.core.dtensor.ops.registry import OpStrategy, register_aten, register_rule
from hyper_parallel.core.dtensor.placement_types import Partial, Replicate


def _ids_placements(call, ids):
    """The indices' placements; a plain (0-dim) index tensor is the same on every rank."""
    spec = call.spec(ids)
    return spec.placements if spec is not None else (Replicate(),) * call.mesh_ndim


def _assign(call, pairs):
    inputs = [None] * len(call.specs)
    for t, placements in pairs:
        if call.index(t) is not None:
            inputs[call.index(t)] = tuple(placements)
    return inputs


@register_rule("aten_embedding")
def aten_embedding_rule(call: Any) -> Any:
    weight, ids = call.args[0], call.args[1]
    w_spec = call.spec(weight)
    sparse = len(call.args) > 4 and call.args[4]
    if w_spec is None or w_spec.ndim != 2 or sparse or not hasattr(ids, "ndim"):
        return None
    w_t, ids_t, out = [], [], []
    for pw, pi in zip(w_spec.placements, _ids_placements(call, ids)):
        if pw.is_shard(1):
            w_t.append(pw)
            ids_t.append(Replicate())
            out.append(pw.with_dim(ids.ndim))
        else:
            keep = pi if pi.is_shard() else Replicate()
            w_t.append(Replicate())
            ids_t.append(keep)
            out.append(keep)
    return OpStrategy(inputs=_assign(call, [(weight, w_t), (ids, ids_t)]), outputs=tuple(out))


@register_rule("aten_embedding_dense_backward")
def embedding_dense_backward_rule(call: Any) -> Any:
    grad, ids = call.args[0], call.args[1]
    g_spec = call.spec(grad)
    if g_spec is None or len(call.args) < 5 or not hasattr(ids, "ndim") or g_spec.ndim != ids.ndim + 1:
        return None
    by_freq = bool(call.args[4])
    g_t, ids_t, out = [], [], []
    for pg, pi in zip(g_spec.placements, _ids_placements(call, ids)):
        if pg.is_shard(g_spec.ndim - 1):
            g_t.append(pg)
            ids_t.append(Replicate())
            out.append(pg.with_dim(1))
            continue
        anchor = pi if pi.is_shard() else pg   # a position dim split by either: both follow it
        if anchor.is_shard() and anchor.dim < ids.ndim and not by_freq:
            g_t.append(anchor)
            ids_t.append(anchor)
            out.append(Partial("sum"))
        else:
            g_t.append(Replicate())
            ids_t.append(Replicate())
            out.append(Replicate())
    return OpStrategy(inputs=_assign(call, [(grad, g_t), (ids, ids_t)]), outputs=tuple(out))


register_aten("aten_embedding", "embedding")
register_aten("aten_embedding_dense_backward", "embedding_dense_backward")

__all__ = ["aten_embedding_rule", "embedding_dense_backward_rule"]
