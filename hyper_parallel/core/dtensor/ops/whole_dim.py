"""Ops along one dim that must be whole on every rank: argmax / argmin, topk, sort / argsort,
kthvalue, mode, median, cummax / cummin / logcumsumexp, and prod (cumsum: scan.py).

The op's dim (every dim when ``dim`` is None: ``argmax(x)``, ``prod(x)``, ``median(x)``) is
gathered on the mesh dims that split it; shards of the other dims stay, moved to their place in
the output (a dim the op removes shifts the later ones down). The indices these ops return are
therefore global. Partial inputs are reduced first (none of these ops is linear).

An exact cross-rank alternative exists for some (a max-loc all-reduce for argmax, a product of
per-rank products for prod); gathering one dim is what they would save, and the layout of every
other dim is kept. (cumprod has no rule yet: tests use it as the example of an op without one.)
"""
from typing import Any
from hyper_parallel.core.dtensor.ops.gather_dims import gather_dims
from hyper_parallel.core.dtensor.ops.registry import OpStrategy, register_rule

# name: (position of dim, its default, position of keepdim or None if the op keeps every dim)
_SIGNATURES = {
    "argmax": (1, None, 2), "argmin": (1, None, 2),
    "median": (1, None, 2), "nanmedian": (1, None, 2),
    "mode": (1, -1, 2), "kthvalue": (2, -1, 3),
    "prod": (1, None, 2),
    "topk": (2, -1, None), "sort": (1, -1, None), "argsort": (1, -1, None),
    "cummax": (1, None, None), "cummin": (1, None, None),
    "logcumsumexp": (1, None, None),
}


def _plain_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


@register_rule(*_SIGNATURES)
def whole_dim_rule(call: Any) -> Any:
    x = call.arg(0, "input")
    spec = call.spec(x)
    if spec is None or call.index(x) != 0:
        return None
    dim_pos, default, keep_pos = _SIGNATURES[call.name]
    dim = call.arg(dim_pos, "dim", default)
    ndim = spec.ndim
    if call.name == "prod" and isinstance(dim, (list, tuple)) and len(dim) == 1:
        dim = dim[0]
    if dim is not None and not _plain_int(dim):
        return None  # named dims and other spellings: the fallback
    if dim is None and keep_pos is None:
        return None  # cumsum & co. without a dim: not a valid call
    removes = keep_pos is not None and not bool(call.arg(keep_pos, "keepdim", False))
    if ndim == 0:
        touched, expected = set(), 0
    elif dim is None:
        touched, expected = set(range(ndim)), 0 if removes else ndim
    else:
        dim %= ndim
        touched, expected = {dim}, ndim - 1 if removes else ndim
    if any(len(s) != expected for s in call.out_shapes):
        return None  # an argument this rule does not read (e.g. dim given another way)

    def out_dim_of(d):
        return d - 1 if removes and dim is not None and d > dim else d
    inputs, outputs = gather_dims(spec, touched, out_dim_of)
    return OpStrategy(inputs=[inputs] + [None] * (len(call.specs) - 1), outputs=outputs)


__all__ = ["gather_dims", "whole_dim_rule"]
