"""Advanced indexing: ``x[idx]`` (aten ``index``) and ``x[idx] = v`` / ``index_put_`` (aten
``index_put``), where ``idx`` holds index tensors (None for a dim taken whole).

A dim that no index tensor touches keeps its shard: every rank indexes its own piece with the same
(replicated) indices, and the piece lands on the output dim that dim becomes (torch puts the
broadcast index dims where the indexed dims were when those are adjacent, in front otherwise).
An embedding-like gather of rows from a tensor split over columns moves nothing. A dim that an index
tensor touches is gathered first, and the index tensors are replicated.

* index: a Partial(sum / avg) input stays Partial (a selection is linear).
* index_put(x, idx, v, accumulate): x keeps a shard of an untouched dim and the values follow it
  (Replicate along dims they broadcast over); a replicated x whose values are split along such a
  dim takes that split (its piece is a local slice), which is how the gradient of ``x[idx]``
  stays split. A Partial x is reduced first.

Boolean masks (``x[mask]``): the number of selected elements depends on the mask's values, so
:func:`prepare_indices` replaces each mask by its ``nonzero`` index tensors, as torch itself does,
computed from the whole mask (gathered if it is a split DTensor). The rule then sees only integer
indices, and a mask over dims that are not split keeps the other dims' shards.
"""
from typing import Any
from hyper_parallel.core.dtensor.ops.elementwise import to_input
from hyper_parallel.core.dtensor.ops.registry import OpStrategy, register_rule
from hyper_parallel.core.dtensor.placement_types import Replicate
from hyper_parallel.platform import get_platform
from hyper_parallel.core.dtensor.dtensor import DTensor, as_layout

_LINEAR = ("sum", "avg")


def _is_mask(t):
    """A bool (or the deprecated uint8) index tensor: a mask, not positions."""
    dtype = getattr(t, "dtype", None)
    return dtype is not None and (dtype == get_platform().bool_dtype() or getattr(dtype, "is_signed", True)
                                  is False)


def prepare_indices(rule_name: str, mesh: Any, args: Any, kwargs: Any) -> Any:
    """(args, kwargs) with every mask of an index / index_put call replaced by its nonzero positions."""
    if rule_name not in ("index", "index_put") or len(args) < 2 or not isinstance(args[1], (list, tuple)):
        return args, kwargs
    indices = []
    for t in args[1]:
        if t is None or not _is_mask(t):
            indices.append(t)
            continue
        if isinstance(t, DTensor):
            t = as_layout(t, t._spec.with_placements((Replicate(),) * mesh.ndim))._local_tensor
        indices.extend(t.nonzero(as_tuple=True))
    return (args[0], indices) + tuple(args[2:]), kwargs


def _parse(call):
    x, indices = call.arg(0, "self"), call.arg(1, "indices")
    spec = call.spec(x)
    if spec is None or call.index(x) != 0 or not isinstance(indices, (list, tuple)):
        return None
    if len(indices) > spec.ndim or any(t is not None and (_is_mask(t) or not hasattr(t, "shape"))
                                       for t in indices):
        return None
    indexed = [d for d, t in enumerate(indices) if t is not None]
    if not indexed:
        return None
    shape = get_platform().broadcast_shapes(*[tuple(t.shape) for t in indices if t is not None])
    return x, spec, indices, indexed, shape


def _destinations(ndim, indexed, index_ndim):
    """Output dim of every dim of x that no index tensor touches."""
    kept = [d for d in range(ndim) if d not in indexed]
    adjacent = indexed == list(range(indexed[0], indexed[-1] + 1))
    if adjacent:
        return {d: d if d < indexed[0] else d - len(indexed) + index_ndim for d in kept}
    return {d: index_ndim + k for k, d in enumerate(kept)}


def _region(x_shape, indexed, index_shape):
    """The shape of ``x[indices]``."""
    if indexed == list(range(indexed[0], indexed[-1] + 1)):
        return tuple(x_shape[:indexed[0]]) + tuple(index_shape) + tuple(x_shape[indexed[-1] + 1:])
    return tuple(index_shape) + tuple(s for d, s in enumerate(x_shape) if d not in indexed)


def _indices_replicated(call, indices, inputs):
    rep = (Replicate(),) * call.mesh_ndim
    for t in indices:
        if t is not None and call.index(t) is not None:
            inputs[call.index(t)] = rep


@register_rule("index")
def index_rule(call: Any) -> Any:
    parsed = _parse(call)
    if parsed is None:
        return None
    x, spec, indices, indexed, shape = parsed
    dest = _destinations(spec.ndim, indexed, len(shape))
    placements, out = [], []
    for p in spec.placements:
        if p.is_shard() and p.dim in dest:
            placements.append(p)
            out.append(p.with_dim(dest[p.dim]))
        elif p.is_partial() and p.reduce_op in _LINEAR:
            placements.append(p)
            out.append(p)
        else:
            placements.append(Replicate())
            out.append(Replicate())
    inputs: list[Any] = [None] * len(call.specs)
    _indices_replicated(call, indices, inputs)
    inputs[0] = tuple(placements)
    return OpStrategy(inputs=inputs, outputs=tuple(out))


@register_rule("index_put")
def index_put_rule(call: Any) -> Any:
    parsed = _parse(call)
    if parsed is None:
        return None
    x, spec, indices, indexed, shape = parsed
    values = call.arg(2, "values")
    vspec = call.spec(values)
    if vspec is not None and call.index(values) == 0:
        return None   # x written with itself: one placement cannot serve both roles
    dest = _destinations(spec.ndim, indexed, len(shape))
    region = _region(spec.shape, indexed, shape)   # the shape x[indices] has
    from_values = {r: d for d, r in dest.items()}
    chosen = []
    for m, p in enumerate(spec.placements):
        if p.is_shard() and p.dim in dest:
            chosen.append(p)
            continue
        pv: Any = vspec.placements[m] if vspec is not None else Replicate()
        r = pv.dim + len(region) - vspec.ndim if pv.is_shard() else None
        if p.is_replicate() and r in from_values and vspec.shape[pv.dim] == region[r] and \
                not any(c.is_shard(from_values[r]) for c in chosen):
            chosen.append(pv.with_dim(from_values[r]))
        else:
            chosen.append(Replicate())
    inputs: list[Any] = [None] * len(call.specs)
    _indices_replicated(call, indices, inputs)
    inputs[0] = tuple(chosen)
    if vspec is not None:
        inputs[call.index(values)] = tuple(
            to_input(c.with_dim(dest[c.dim]), vspec.shape, region) if c.is_shard() else Replicate()
            for c in chosen)
    return OpStrategy(inputs=inputs, outputs=tuple(chosen))


__all__ = ["index_put_rule", "index_rule", "prepare_indices"]
