"""index_select, gather and scatter / scatter_add / scatter_reduce along a dim ``d``.

A shard of a dim the op does not index is kept whenever every tensor it touches has that dim
with the same size (then their ``torch.chunk`` pieces line up element for element); the op then
runs on the local pieces as it is. Per mesh dim, in order of preference:

* index_select(x, d, index):
  - x split on a dim e != d: kept (the index is replicated), the output split on e;
  - x Partial(sum / avg): kept (selection is linear), the output Partial;
  - the index split (1-D, its dim 0) and x replicated: the output split on d;
  - otherwise everything replicated (x split on d is gathered).
* gather(x, d, index) (output shaped as the index):
  - x or the index split on a dim e != d where both have the same size: both split on e;
  - the index split on d and x replicated: the output split on d (every row looks in all of x);
  - x Partial(sum / avg), the index replicated: the output Partial;
  - otherwise everything replicated.
* scatter*(x, d, index, src or value): x, the index and src split on one dim e != d where all
  three have the same size; otherwise replicated (a Partial input is reduced first).
* index_add / index_copy (x, d, index, source) and index_fill (x, d, index, value): x and source
  split on one dim e != d where both have the same size, the (1-D) index and value replicated;
  otherwise replicated. Their in-place forms run through these rules (aten_rules.py).
"""
from typing import Any
import functools

from hyper_parallel.core.dtensor.ops.registry import OpStrategy, register_rule
from hyper_parallel.core.dtensor.placement_types import Replicate

_LINEAR = ("sum", "avg")


def _args(call, third):
    x, dim, index = call.arg(0, "input"), call.arg(1, "dim"), call.arg(2, "index")
    other = call.arg(3, third) if third else None
    spec = call.spec(x)
    if spec is None and getattr(x, "ndim", None) == 0 and isinstance(dim, int):
        return x, 0, index, other  # a 0-dim plain input beside DTensor indices: _zero_dim replicates
    if spec is None or call.index(x) != 0 or not isinstance(dim, int) or isinstance(dim, bool):
        return None
    if not hasattr(index, "ndim") or (call.spec(index) is None and index.ndim > 0):
        return None
    return x, dim % max(spec.ndim, 1), index, other


def _zero_dim(call, x):
    spec = call.spec(x)
    return spec is None or spec.ndim == 0


def _replicated(call):
    """0-dim inputs (nothing to split): every DTensor input replicated."""
    rep = (Replicate(),) * call.mesh_ndim
    return OpStrategy(inputs=[rep] * len(call.specs), outputs=rep)


def _index_placements(call, index):
    """The index's placements; a 0-dim plain index (never promoted to a DTensor) is replicated."""
    spec = call.spec(index)
    return spec.placements if spec is not None else (Replicate(),) * call.mesh_ndim


def _strategy(call, tensors, per_dim):
    """``per_dim``: per mesh dim, the placement of each of ``tensors`` and then of the output."""
    inputs = [None] * len(call.specs)
    for k, t in enumerate(tensors):
        if call.index(t) is not None:
            inputs[call.index(t)] = tuple(p[k] for p in per_dim)
    return OpStrategy(inputs=inputs, outputs=tuple(p[-1] for p in per_dim))


def _indexing_rule(name, third=None):
    """Registers ``body(call, x, d, index, other)`` for ``name`` after the checks every rule here
    shares: arguments it understands (else the fallback), a 0-dim input (all replicated).
    ``third(call)`` names the fourth argument (scatter's src or value)."""
    def wrap(body):
        @register_rule(name)
        @functools.wraps(body)
        def rule(call):
            parsed = _args(call, third(call) if third else None)
            if parsed is None:
                return None
            if _zero_dim(call, parsed[0]):
                return _replicated(call)
            return body(call, *parsed)
        return rule
    return wrap


def _linear_partial(px, pj):
    """x's pending sum / mean passes through a selection by a replicated (not Partial) index."""
    return px.is_partial() and px.reduce_op in _LINEAR and not pj.is_partial()


_REPLICATED = (Replicate(), Replicate(), Replicate())


@_indexing_rule("index_select")
def index_select_rule(call: Any, x: Any, d: Any, index: Any, _: Any) -> Any:
    index_1d = index.ndim == 1

    def choose(px, pj):
        if (px.is_shard() and px.dim != d) or _linear_partial(px, pj):
            return px, Replicate(), px
        if pj.is_shard(0) and index_1d:
            return Replicate(), pj, pj.with_dim(d)
        return _REPLICATED
    return _strategy(call, [x, index], [choose(px, pj) for px, pj in
                                        zip(call.spec(x).placements, _index_placements(call, index))])


def _aligned(specs, p, d):
    """Whether shard ``p`` (of a dim != d) may split every spec in ``specs`` alike."""
    if not p.is_shard() or p.dim == d:
        return False
    return all(s.ndim > p.dim and s.shape[p.dim] == specs[0].shape[p.dim] for s in specs)


@_indexing_rule("gather")
def gather_rule(call: Any, x: Any, d: Any, index: Any, _: Any) -> Any:
    xs, js = call.spec(x), call.spec(index)
    if js is None or js.ndim != xs.ndim:
        return None

    def choose(px, pj):
        if _aligned([xs, js], px, d):
            return px, px, px
        if _aligned([xs, js], pj, d) and not px.is_partial():
            return pj, pj, pj
        if pj.is_shard(d) and not px.is_partial():
            return Replicate(), pj, pj
        if _linear_partial(px, pj):
            return px, Replicate(), px
        return _REPLICATED
    return _strategy(call, [x, index], [choose(px, pj) for px, pj in zip(xs.placements, js.placements)])


@_indexing_rule("scatter", third=lambda call: "src" if call.arg(3, "src") is not None else "value")
def scatter_rule(call: Any, x: Any, d: Any, index: Any, src: Any) -> Any:
    specs = [call.spec(t) for t in (x, index, src) if call.spec(t) is not None]
    if any(s.ndim != specs[0].ndim for s in specs):
        return None
    per_dim = []
    for m in range(call.mesh_ndim):
        chosen = next((s.placements[m] for s in specs if _aligned(specs, s.placements[m], d)), Replicate())
        per_dim.append((chosen,) * 4)
    return _strategy(call, [x, index, src], per_dim)


def _index_update(call, x, d, index, other):
    specs = [call.spec(t) for t in (x, other) if call.spec(t) is not None]
    if any(s.ndim != specs[0].ndim for s in specs) or call.index(other) == 0:
        return None
    per_dim = []
    for m in range(call.mesh_ndim):
        chosen = next((s.placements[m] for s in specs if _aligned(specs, s.placements[m], d)), Replicate())
        source = chosen if call.spec(other) is not None and call.spec(other).ndim else Replicate()
        per_dim.append((chosen, Replicate(), source, chosen))
    return _strategy(call, [x, index, other], per_dim)


for _name, _third in (("index_add", "source"), ("index_copy", "source"), ("index_fill", "value")):
    _indexing_rule(_name, third=lambda call, third=_third: third)(_index_update)


__all__ = ["gather_rule", "index_select_rule", "scatter_rule"]
