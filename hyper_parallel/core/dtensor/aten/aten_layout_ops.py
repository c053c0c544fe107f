"""Aten ops that move or select values without combining them across a split dim: fill, roll,
cumprod, aminmax, glu, diagonal (+ backward), tril / triu, pixel_shuffle / pixel_unshuffle.

Each keeps the shards of the dims it does not work along (moved to where the dim lands in the
output) and gathers the dims it works along (gather_dims). A Partial passes only through ops that
are linear in their input (roll, diagonal and its backward move values); the others reduce it first.
"""
from typing import Any
from hyper_parallel.core.dtensor.ops.empty_pieces import without_empty_pieces
from hyper_parallel.core.dtensor.ops.gather_dims import gather_dims
from hyper_parallel.core.dtensor.ops.registry import OpStrategy, register_aten, register_rule
from hyper_parallel.core.dtensor.placement_types import Replicate, Shard


def _first(call):
    """The first argument's spec when it is the call's first DTensor, else None."""
    x = call.args[0] if call.args else None
    return call.spec(x) if x is not None and call.index(x) == 0 else None


def _only_first(call, inputs, outputs, local=None):
    return OpStrategy(inputs=[inputs] + [None] * (len(call.specs) - 1), outputs=outputs, local=local)


@register_rule("aten_fill")
def fill_rule(call: Any) -> Any:
    """fill(self, value): the output never reads self's values, so self does not move; where self
    is Partial the output is the value everywhere: Replicate. A tensor value is replicated."""
    spec = _first(call)
    if spec is None:
        return None
    out = tuple(Replicate() if p.is_partial() else p for p in spec.placements)
    inputs = [spec.placements] + [(Replicate(),) * call.mesh_ndim] * (len(call.specs) - 1)
    return OpStrategy(inputs=inputs, outputs=out)


@register_rule("aten_roll")
def roll_rule(call: Any) -> Any:
    """roll(self, shifts, dims): the rolled dims are gathered (no dims: the flattened tensor rolls,
    every dim is gathered)."""
    spec = _first(call)
    dims = call.args[2] if len(call.args) > 2 else call.kwargs.get("dims", [])
    if spec is None or not isinstance(dims, (list, tuple)):
        return None
    rolled = {d % max(spec.ndim, 1) for d in dims} if dims else set(range(spec.ndim))
    inputs, outputs = gather_dims(spec, rolled, lambda d: d, partial_stays=True)
    return _only_first(call, inputs, outputs)


@register_rule("aten_cumprod")
def cumprod_rule(call: Any) -> Any:
    """cumprod(self, dim): a product along dim (not linear: a Partial is reduced)."""
    spec = _first(call)
    dim = call.args[1] if len(call.args) > 1 else call.kwargs.get("dim")
    if spec is None or not isinstance(dim, int) or isinstance(dim, bool):
        return None
    inputs, outputs = gather_dims(spec, {dim % max(spec.ndim, 1)}, lambda d: d)
    return _only_first(call, inputs, outputs)


@register_rule("aten_aminmax")
def aminmax_rule(call: Any) -> Any:
    """aminmax(self, *, dim=None, keepdim=False) -> (min, max): the reduced dim(s) are gathered."""
    spec = _first(call)
    dim, keepdim = call.kwargs.get("dim"), bool(call.kwargs.get("keepdim", False))
    if spec is None or len(call.args) > 1 or (dim is not None and not isinstance(dim, int)):
        return None
    if dim is None:
        touched = set(range(spec.ndim))
        out_dim = (lambda d: d)
    else:
        dim %= max(spec.ndim, 1)
        touched = {dim}
        out_dim = (lambda d: d if keepdim or d < dim else d - 1)
    inputs, outputs = gather_dims(spec, touched, out_dim)
    return _only_first(call, inputs, [outputs, outputs])


@register_rule("aten_glu")
def glu_rule(call: Any) -> Any:
    """glu(self, dim) and glu_backward(grad_output, self, dim): the halved dim is gathered; the
    gradient (of self's shape) follows self, grad_output (halved dim) takes the same layout."""
    backward = call.name == "aten_glu_backward"
    x = call.args[1] if backward else call.args[0]
    spec = call.spec(x)
    dim = call.args[2 if backward else 1] if len(call.args) > (2 if backward else 1) else -1
    if spec is None or spec.ndim == 0 or not isinstance(dim, int):
        return None
    inputs, outputs = gather_dims(spec, {dim % spec.ndim}, lambda d: d)
    return OpStrategy(inputs=[inputs] * len(call.specs), outputs=outputs)


register_rule("aten_glu_backward")(glu_rule)


def _diagonal_dims(ndim, args, first):
    offset = args[first] if len(args) > first else 0
    d1 = args[first + 1] if len(args) > first + 1 else 0
    d2 = args[first + 2] if len(args) > first + 2 else 1
    return offset, d1 % ndim, d2 % ndim


@register_rule("aten_diagonal")
def diagonal_rule(call: Any) -> Any:
    """diagonal(self, offset, dim1, dim2): dim1 and dim2 are gathered; the other dims keep their
    order in the output, the diagonal is appended last."""
    spec = _first(call)
    if spec is None or spec.ndim < 2 or call.kwargs:
        return None
    _, d1, d2 = _diagonal_dims(spec.ndim, call.args, 1)
    rest = [d for d in range(spec.ndim) if d not in (d1, d2)]
    inputs, outputs = gather_dims(spec, {d1, d2}, rest.index, partial_stays=True)
    return _only_first(call, inputs, outputs)


@register_rule("aten_diagonal_backward")
def diagonal_backward_rule(call: Any) -> Any:
    """diagonal_backward(grad, input_sizes, offset, dim1, dim2): the inverse placement move; each
    rank builds its own piece (its local input sizes)."""
    spec = _first(call)
    if spec is None or len(call.args) < 5 or call.kwargs:
        return None
    sizes = tuple(call.args[1])
    _, d1, d2 = _diagonal_dims(len(sizes), call.args, 2)
    rest = [d for d in range(len(sizes)) if d not in (d1, d2)]
    inputs, outputs = gather_dims(spec, {spec.ndim - 1}, lambda k: rest[k], partial_stays=True)

    def diagonal_backward_on_shard(call_, args, kwargs):
        local_sizes = list(sizes)
        for k, d in enumerate(rest):
            local_sizes[d] = args[0].shape[k]
        return call_.func(args[0], local_sizes, *args[2:])
    return _only_first(call, inputs, outputs, local=diagonal_backward_on_shard)


@register_rule("aten_tril")
def tril_rule(call: Any) -> Any:
    """tril / triu(self, diagonal): batch shards pass. A plain Shard of one of the last two dims
    stays too: element (i, j) is kept by j - i <= k (tril) / >= k (triu), so a piece whose rows
    start at r0 and columns at c0 is the piece's own tril / triu with diagonal k + r0 - c0. Strided
    splits of those dims are gathered. Masking is linear: a Partial passes through."""
    spec = _first(call)
    k = call.args[1] if len(call.args) > 1 else call.kwargs.get("diagonal", 0)
    if spec is None or spec.ndim < 2 or not isinstance(k, int):
        return None
    matrix = {spec.ndim - 2, spec.ndim - 1}
    strided = {p.dim for p in spec.placements if p.is_shard() and type(p) is not Shard}
    inputs, outputs = gather_dims(spec, matrix & strided, lambda d: d, partial_stays=True)
    if not any(p.is_shard() and p.dim in matrix for p in inputs):
        return _only_first(call, inputs, outputs)
    box = spec.with_placements(inputs).local_box()
    shift = box[-2][0] - box[-1][0]

    def tril_on_shard(call_, args, kwargs):
        return call_.func(args[0], k + shift)
    return _only_first(call, inputs, outputs, local=tril_on_shard)


register_rule("aten_triu")(tril_rule)


@register_rule("aten_pixel_shuffle")
def pixel_shuffle_rule(call: Any) -> Any:
    """pixel_shuffle / pixel_unshuffle: the last three dims (C, H, W) trade sizes; the batch dims
    before them keep their shards."""
    spec = _first(call)
    if spec is None or spec.ndim < 3:
        return None
    inputs, _ = gather_dims(spec, set(range(spec.ndim - 3, spec.ndim)), lambda d: d)
    inputs = without_empty_pieces(spec, inputs)
    return _only_first(call, inputs, inputs)


register_aten("aten_fill", "fill")
register_aten("aten_roll", "roll")
register_aten("aten_cumprod", "cumprod", in_place=True)
register_aten("aten_aminmax", "aminmax")
register_aten("aten_glu", "glu")
register_aten("aten_glu_backward", "glu_backward")
register_aten("aten_diagonal", "diagonal", "diagonal_copy")
register_aten("aten_diagonal_backward", "diagonal_backward")
register_aten("aten_tril", "tril", in_place=True)
register_aten("aten_triu", "triu", in_place=True)
register_aten("aten_pixel_shuffle", "pixel_shuffle", "pixel_unshuffle")

__all__ = ["fill_rule", "roll_rule", "cumprod_rule", "aminmax_rule", "glu_rule", "diagonal_rule",
           "diagonal_backward_rule", "pixel_shuffle_rule", "tril_rule"]
