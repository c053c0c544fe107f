"""Reductions: sum, mean, amax, amin (``dim`` None / int / list, ``keepdim``); max / min.

Per mesh dim, for the input placement ``p``:

* ``Shard(d)`` with d not reduced: kept, moved to d's position in the output.
* ``Shard(d)`` with d reduced:
  - sum:  each rank sums its shard -> ``Partial(sum)``.
  - mean: each rank sums its shard and divides by the GLOBAL count of reduced elements ->
    ``Partial(sum)``. Exact for uneven (``torch.chunk``) shards, empty ones included.
  - amax / amin: each rank reduces its shard, then a differentiable all-reduce(max / min) inside
    the op gives ``Replicate``. Its backward sends the (replicated) gradient only to the ranks
    holding the winning value (split evenly when several ranks tie), and the local amax backward
    then picks the local winner(s). Ties *within* and *across* ranks are therefore split per rank
    first, then per element, where torch on one device splits over all tied elements at once;
    without ties the gradients are identical. If some rank would hold an empty piece of a reduced
    dim (a reduction over an empty dim has no identity for max/min), that mesh dim is gathered.
* ``Replicate``: stays.
* ``Partial(op)``: sum and mean are linear, so a ``Partial(sum / avg)`` input stays Partial
  (the same op); ``Partial(max / min)`` and any Partial input of amax / amin are all-reduced to
  ``Replicate`` first (a local amax of a partial value would send gradients to every rank's
  local winner).
"""
from typing import Any
import functools
import itertools
import math

from hyper_parallel.core.dtensor.layout import local_box
from hyper_parallel.core.dtensor.ops.registry import OpStrategy, register_aten, register_rule
from hyper_parallel.core.dtensor.placement_types import Partial, Replicate
from hyper_parallel.platform import get_platform

_LINEAR_PARTIAL = ("sum", "avg")


def reduced_dims(dim: Any, ndim: Any) -> Any:
    """The sorted, non-negative input dims a reduction with ``dim`` removes (None / () = all)."""
    if ndim == 0:
        return []
    if dim is None:
        return list(range(ndim))
    dims = [dim] if isinstance(dim, int) else list(dim)
    if not dims:
        return list(range(ndim))
    return sorted({d % ndim for d in dims})


def _dim_arg(call):
    if len(call.args) > 1:
        return call.args[1]
    if "dim" in call.kwargs:
        return call.kwargs["dim"]
    return call.kwargs.get("axis")


def _keepdim_arg(call):
    if len(call.args) > 2:
        return bool(call.args[2])
    return bool(call.kwargs.get("keepdim", call.kwargs.get("keepdims", False)))


def output_dim(d: Any, reduced: Any, keepdim: Any) -> Any:
    """Where input dim ``d`` (not reduced) sits in the output."""
    return d if keepdim else d - sum(1 for r in reduced if r < d)


def _some_piece_empty(spec, placements, dims):
    """Whether any rank's piece of a tensor dim in ``dims`` is empty (checked on every mesh
    coordinate, so that every rank takes the same decision)."""
    return _any_empty(tuple(spec.shape), tuple(placements), tuple(spec.mesh.mesh_shape), tuple(dims))


@functools.lru_cache(maxsize=1024)
def _any_empty(shape, placements, mesh_shape, dims):
    for coord in itertools.product(*[range(n) for n in mesh_shape]):
        box = local_box(shape, placements, mesh_shape, coord)
        if any(box[d][1] == 0 for d in dims):
            return True
    return False


def combined_reduction_layout(spec: Any, reduced: Any, keepdim: Any) -> Any:
    """(input placements, output placements, mesh dims that split a reduced dim) of a non-linear
    reduction whose split dims are combined inside the op (logsumexp, var / std): those stay split
    and give a Replicate output; shards of other dims move to their output dim; Partials are
    reduced first."""
    inputs, outputs, mesh_dims = [], [], []
    for m, p in enumerate(spec.placements):
        if p.is_shard() and p.dim in reduced:
            inputs.append(p)
            outputs.append(Replicate())
            mesh_dims.append(m)
        elif p.is_shard():
            inputs.append(p)
            outputs.append(p.with_dim(output_dim(p.dim, reduced, keepdim)))
        else:
            inputs.append(Replicate())
            outputs.append(Replicate())
    return tuple(inputs), tuple(outputs), mesh_dims


@register_rule("sum", "mean", "amax", "amin")
def reduction_rule(call: Any) -> Any:
    return _reduction(call, call.name)


def _reduction(call, kind):
    x = call.args[0] if call.args else call.kwargs.get("input")
    spec = call.spec(x)
    if spec is None or call.index(x) != 0:
        return None
    ndim = spec.ndim
    reduced = reduced_dims(_dim_arg(call), ndim)
    keepdim = _keepdim_arg(call)
    extreme = kind in ("amax", "amin")
    if len(call.out_shapes[0]) != (ndim if keepdim else ndim - len(reduced)):
        return None  # an argument spelling this rule does not understand: take the fallback

    inputs, outputs, reduce_mesh_dims = [], [], []
    for m, p in enumerate(spec.placements):
        if p.is_shard() and p.dim in reduced:
            inputs.append(p)
            outputs.append(Replicate() if extreme else Partial("sum"))
            reduce_mesh_dims.append(m)
        elif p.is_shard():
            inputs.append(p)
            outputs.append(p.with_dim(output_dim(p.dim, reduced, keepdim)))
        elif p.is_partial() and not extreme and p.reduce_op in _LINEAR_PARTIAL:
            inputs.append(p)
            outputs.append(p)
        else:
            inputs.append(Replicate())
            outputs.append(Replicate())

    if extreme and reduce_mesh_dims:
        sharded_reduced = sorted({spec.placements[m].dim for m in reduce_mesh_dims})
        if _some_piece_empty(spec, tuple(inputs), sharded_reduced):
            for m in reduce_mesh_dims:
                inputs[m] = Replicate()
                outputs[m] = Replicate()
            reduce_mesh_dims = []

    inputs, outputs = tuple(inputs), tuple(outputs)
    local = None
    if reduce_mesh_dims and kind == "mean":
        count = math.prod(spec.shape[d] for d in reduced)
        local = _mean_local(reduced, keepdim, count)
    elif reduce_mesh_dims and extreme:
        local = _extreme_local(call.mesh, reduce_mesh_dims, "max" if kind == "amax" else "min")
    return OpStrategy(inputs=[inputs] + [None] * (len(call.specs) - 1), outputs=outputs, local=local)


@register_rule("max", "min")
def max_min_rule(call: Any) -> Any:
    """``max(x)``: like amax over every dim. ``max(x, other)``: elementwise. ``max(x, dim)``:
    (values, indices) over a dim that must be whole (a mesh dim sharding it is gathered; the
    indices are then global), other shards kept."""
    from hyper_parallel.core.dtensor.ops.elementwise import elementwise_rule
    second = call.args[1] if len(call.args) > 1 else call.kwargs.get("other", call.kwargs.get("dim"))
    if second is None:
        return _reduction(call, "amax" if call.name == "max" else "amin")
    if not isinstance(second, int) or isinstance(second, bool):
        return elementwise_rule(call)
    spec = call.specs[0]
    if call.index(call.args[0] if call.args else call.kwargs.get("input")) != 0 or spec.ndim == 0:
        return None
    dim = second % spec.ndim
    keepdim = _keepdim_arg(call)
    placements = []
    for p in spec.placements:
        if p.is_partial() or p.is_shard(dim):
            placements.append((Replicate(), Replicate()))
        elif p.is_shard():
            placements.append((p, p.with_dim(output_dim(p.dim, [dim], keepdim))))
        else:
            placements.append((p, p))
    inputs = tuple(i for i, _ in placements)
    return OpStrategy(inputs=[inputs] + [None] * (len(call.specs) - 1),
                      outputs=tuple(o for _, o in placements))


def _mean_local(reduced, keepdim, count):
    """Local sum over ``reduced`` divided by the global element count (a Partial(sum) piece)."""
    def mean_over_shards(call, args, kwargs):
        x = args[0] if args else kwargs["input"]
        dtype = kwargs.get("dtype")
        if dtype is not None:
            x = x.to(dtype)
        # the platform's sum: MindSpore's kernel leaves the sum of an empty (uneven) piece unset
        return get_platform().local_sum(x, dim=reduced, keepdim=keepdim) / count
    return mean_over_shards


def _extreme_local(mesh, mesh_dims, op):
    """The local amax / amin, then a differentiable all-reduce over each reducing mesh dim."""
    platform = get_platform()

    def extreme_over_shards(call, args, kwargs):
        out = call.func(*args, **kwargs)
        for m in mesh_dims:
            out = platform.differentiable_all_reduce(out.contiguous(), mesh.get_group(m), op,
                                                     backward="identity")
        return out
    return extreme_over_shards


# the aten forms (reached below autograd, e.g. in the backward of cumprod or group norm) take the same
# arguments in the same positions (``amax(self, dim=[])``: [] is every dim, as reduced_dims reads it)
for _name in ("mean", "amax", "amin", "max", "min"):
    register_aten(_name, _name)

__all__ = ["reduced_dims", "output_dim", "combined_reduction_layout", "reduction_rule", "max_min_rule"]
