"""Ops along one dim that must be whole on every rank: argmax / argmin, topk, sort / argsort,
kthvalue, mode, median, cumsum / cumprod / cummax / cummin / logcumsumexp, and prod.

The op's dim (every dim when ``dim`` is None: ``argmax(x)``, ``prod(x)``, ``median(x)``) is
gathered on the mesh dims that split it; shards of the other dims stay, moved to their place in
the output (a dim the op removes shifts the later ones down). The indices these ops return are
therefore global. Partial inputs are reduced first (the ops are not linear), except for cumsum,
which is: ``cumsum(sum_r x_r) = sum_r cumsum(x_r)``, so a Partial(sum / avg) input stays Partial.

An exact cross-rank alternative exists for some (a prefix offset for cumsum, a max-loc all-reduce
for argmax); gathering one dim is what they would save, and the layout of every other dim is kept.
"""
from hyper_parallel.core.dtensor.ops.registry import OpStrategy, register_rule
from hyper_parallel.core.dtensor.placement_types import Replicate

_LINEAR_PARTIAL = ("sum", "avg")

# name: (position of dim, its default, position of keepdim or None if the op keeps every dim,
#        whether the op is linear in its input)
_SIGNATURES = {
    "argmax": (1, None, 2, False), "argmin": (1, None, 2, False),
    "median": (1, None, 2, False), "nanmedian": (1, None, 2, False),
    "mode": (1, -1, 2, False), "kthvalue": (2, -1, 3, False),
    "prod": (1, None, 2, False),
    "topk": (2, -1, None, False), "sort": (1, -1, None, False), "argsort": (1, -1, None, False),
    "cumsum": (1, None, None, True), "cumprod": (1, None, None, False),
    "cummax": (1, None, None, False), "cummin": (1, None, None, False),
    "logcumsumexp": (1, None, None, False),
}


def gather_dims(spec, dims, out_dim_of, linear=False):
    """(input placements, output placements): shards of ``dims`` and non-linear Partials are
    replicated; other shards kept and moved by ``out_dim_of`` (input dim -> output dim)."""
    inputs, outputs = [], []
    for p in spec.placements:
        keep_partial = linear and p.is_partial() and p.reduce_op in _LINEAR_PARTIAL
        if (p.is_shard() and p.dim in dims) or (p.is_partial() and not keep_partial):
            inputs.append(Replicate())
            outputs.append(Replicate())
        elif p.is_shard():
            inputs.append(p)
            outputs.append(p.with_dim(out_dim_of(p.dim)))
        else:
            inputs.append(p)
            outputs.append(p)
    return tuple(inputs), tuple(outputs)


def _plain_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


@register_rule(*_SIGNATURES)
def whole_dim_rule(call):
    x = call.arg(0, "input")
    spec = call.spec(x)
    if spec is None or call.index(x) != 0:
        return None
    dim_pos, default, keep_pos, linear = _SIGNATURES[call.name]
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
    inputs, outputs = gather_dims(spec, touched, out_dim_of, linear)
    return OpStrategy(inputs=[inputs] + [None] * (len(call.specs) - 1), outputs=outputs)


__all__ = ["gather_dims", "whole_dim_rule"]
