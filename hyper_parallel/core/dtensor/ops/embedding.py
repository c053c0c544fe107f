"""F.embedding(ids, weight): a lookup of rows of ``weight`` (num_embeddings, dim) by ``ids``.

Per mesh dim, by the weight's placement:

* ``Replicate``: the output follows the ids (a shard of ids dim d is a shard of output dim d).
* ``Shard(1)`` (colwise: each rank holds some embedding columns): ids are replicated, the output
  is ``Shard(-1)`` (the last output dim).
* ``Shard(0)`` (rowwise / vocab-parallel: each rank holds a range of rows): ids are replicated;
  each rank looks up the ids that fall in its row range (the others read local row 0 and are then
  zeroed), so the output is ``Partial(sum)``. This is what RowwiseParallel on nn.Embedding needs.
  An out-of-range id's gradient is zero, so local row 0 gets nothing from it.
* ``Partial`` weight: replicated first. Partial ids (integers) are replicated.

``padding_idx`` is a global row index: for a vocab-sharded weight it is passed (shifted) only to
the rank that holds that row. ``max_norm`` (renormalises weight rows in place),
``scale_grad_by_freq`` (counts per batch) and ``sparse`` gradients have no rule: those calls take
the replicated fallback.
"""
from typing import Any
from hyper_parallel.core.dtensor.ops.registry import OpStrategy, register_rule
from hyper_parallel.core.dtensor.placement_types import Partial, Replicate

_ARGS = ("input", "weight", "padding_idx", "max_norm", "norm_type", "scale_grad_by_freq", "sparse")


def _values(args, kwargs):
    vals = {name: (args[i] if i < len(args) else kwargs.get(name)) for i, name in enumerate(_ARGS)}
    if vals["norm_type"] is None:
        vals["norm_type"] = 2.0
    return vals


@register_rule("embedding")
def embedding_rule(call: Any) -> Any:
    v = _values(call.args, call.kwargs)
    ids, weight = v["input"], v["weight"]
    ids_spec, w_spec = call.spec(ids), call.spec(weight)
    if ids_spec is None or w_spec is None or w_spec.ndim != 2:
        return None
    if v["max_norm"] is not None or v["scale_grad_by_freq"] or v["sparse"]:
        return None
    out_ndim = ids_spec.ndim + 1
    ids_t: list[Any] = []
    w_t: list[Any] = []
    out: list[Any] = []
    vocab_mesh_dims: list[int] = []
    for m in range(call.mesh_ndim):
        pi, pw = ids_spec.placements[m], w_spec.placements[m]
        if pw.is_shard(0):
            ids_t.append(Replicate())
            w_t.append(pw)
            out.append(Partial("sum"))
            vocab_mesh_dims.append(m)
        elif pw.is_shard(1):
            ids_t.append(Replicate())
            w_t.append(pw)
            out.append(pw.with_dim(out_ndim - 1))
        else:
            keep_ids = pi if pi.is_shard() else Replicate()
            ids_t.append(keep_ids)
            w_t.append(Replicate())
            out.append(keep_ids)
    inputs: list[Any] = [None] * len(call.specs)
    inputs[call.index(ids)], inputs[call.index(weight)] = tuple(ids_t), tuple(w_t)
    local = None
    if vocab_mesh_dims:
        row_start, rows = w_spec.with_placements(tuple(w_t)).local_box()[0]
        local = _vocab_parallel_local(row_start, rows, w_spec.shape[0])
    return OpStrategy(inputs=inputs, outputs=tuple(out), local=local)


def _vocab_parallel_local(row_start, rows, vocab):
    """Lookup of the ids in [row_start, row_start + rows); the others give zeros."""
    def vocab_parallel_lookup(call, args, kwargs):
        v = _values(args, kwargs)
        ids, weight, padding_idx = v["input"], v["weight"], v["padding_idx"]
        if padding_idx is not None:
            padding_idx = padding_idx + vocab if padding_idx < 0 else padding_idx
            padding_idx = padding_idx - row_start if row_start <= padding_idx < row_start + rows else None
        outside = (ids < row_start) | (ids >= row_start + rows)
        if rows == 0:
            # no rows here: zeros, still connected to the (empty) weight for autograd with a zero
            # gradient; the platform's sum over the vocab dim is zeros of shape (dim,) on an empty
            # table (MindSpore's own kernel would leave it uninitialised)
            from hyper_parallel.platform import get_platform
            zeros = weight.new_zeros(tuple(ids.shape) + (weight.shape[1],))
            return zeros + get_platform().local_sum(weight, dim=0)
        local_ids = (ids - row_start).masked_fill(outside, 0)
        out = call.func(local_ids, weight, padding_idx, None, v["norm_type"], False, False)
        return out.masked_fill(outside.unsqueeze(-1), 0)
    return vocab_parallel_lookup


__all__ = ["embedding_rule"]
