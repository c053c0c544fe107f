"""split, chunk, unbind, narrow and basic indexing (``x[...]`` with ints, slices, None, Ellipsis).

A tensor dim that is split or sliced must be whole on every rank, so a mesh dim sharding it is
gathered first — unless the piece is the whole dim (``narrow(d, 0, size)``, ``x[:, :]``,
``chunk(1)``), in which case the shard is kept. Every other shard stays and moves to its dim in
the output (an int index removes a dim, ``None`` inserts one, ``unbind`` removes its dim).
These ops only move data, so a Partial input of any reduce op stays Partial.

Indexing with tensors, lists or bools (advanced indexing) has no rule: the call takes the
replicated fallback.
"""
from typing import Any, Optional
from hyper_parallel.core.dtensor.ops.gather_dims import gather_dims
from hyper_parallel.core.dtensor.ops.registry import OpStrategy, register_rule


def _source(call):
    x = call.args[0] if call.args else call.kwargs.get("input", call.kwargs.get("tensor"))
    spec = call.spec(x)
    if spec is None or call.index(x) != 0 or len(call.specs) != 1 or spec.ndim == 0:
        return None
    return spec


def _is_sharded(spec, dim):
    return any(p.is_shard(dim) for p in spec.placements)


def _whole_local(dim, as_tuple):
    """Local op for a piece that is the whole (sharded) dim: the local shard itself."""
    def split_whole_dim(call, args, kwargs):
        x = args[0] if args else kwargs.get("input", kwargs.get("tensor"))
        view = x.narrow(dim, 0, x.shape[dim])
        return (view,) if as_tuple else view
    return split_whole_dim


@register_rule("split", "chunk")
def split_rule(call: Any) -> Any:
    spec = _source(call)
    if spec is None:
        return None
    dim = call.arg(2, "dim", 0) % spec.ndim
    whole = len(call.out_shapes) == 1 and call.out_shapes[0][dim] == spec.shape[dim]
    local = None
    if whole and _is_sharded(spec, dim):
        touched = set()
        local = _whole_local(dim, as_tuple=True)
    else:
        touched = {dim}
    inputs, outputs = gather_dims(spec, touched, lambda d: d, partial_stays=True)
    return OpStrategy(inputs=[inputs], outputs=outputs, local=local)


@register_rule("tensor_split")
def tensor_split_rule(call: Any) -> Any:
    """tensor_split with a DTensor of split indices: torch reads the indices' values from memory
    on the host, which a DTensor wrapper does not have (torch would fail with an unallocated-data
    error); every other spelling goes down to the aten split / slice ops (None)."""
    second = call.arg(1, "indices_or_sections", call.kwargs.get("sections", call.kwargs.get("indices")))
    if call.index(second) is not None:
        raise ValueError("tensor_split: indices_or_sections is a DTensor, whose values torch would read "
                         "on the host; pass its values instead (dt.full_tensor(), or a list of ints)")
    return None


@register_rule("unbind")
def unbind_rule(call: Any) -> Any:
    spec = _source(call)
    if spec is None:
        return None
    dim = call.arg(1, "dim", 0) % spec.ndim
    inputs, outputs = gather_dims(spec, {dim}, lambda d: d - 1 if d > dim else d, partial_stays=True)
    return OpStrategy(inputs=[inputs], outputs=outputs)


@register_rule("narrow")
def narrow_rule(call: Any) -> Any:
    spec = _source(call)
    if spec is None:
        return None
    dim, start, length = call.arg(1, "dim"), call.arg(2, "start"), call.arg(3, "length")
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (dim, start, length)):
        return None
    dim %= spec.ndim
    size = spec.shape[dim]
    start = start + size if start < 0 else start
    local = None
    if start == 0 and length == size and _is_sharded(spec, dim):
        touched = set()
        local = _whole_local(dim, as_tuple=False)
    else:
        touched = {dim}
    inputs, outputs = gather_dims(spec, touched, lambda d: d, partial_stays=True)
    return OpStrategy(inputs=[inputs], outputs=outputs, local=local)


# ------------------------------------------------------------------------------------ indexing
def _plain_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def _basic_item(item):
    if item is None or item is Ellipsis or _plain_int(item):
        return True
    if isinstance(item, slice):
        return all(v is None or _plain_int(v) for v in (item.start, item.stop, item.step))
    return False


def expand_index(index: Any, ndim: Any) -> Any:
    """The index as a list with Ellipsis expanded and trailing dims made explicit, or None when it
    is not basic indexing (tensors, lists, bools)."""
    items = list(index) if isinstance(index, tuple) else [index]
    if not all(_basic_item(i) for i in items) or sum(1 for i in items if i is Ellipsis) > 1:
        return None
    consuming = sum(1 for i in items if i is not None and i is not Ellipsis)
    if consuming > ndim:
        return None
    fill = [slice(None)] * (ndim - consuming)
    if Ellipsis in items:
        at = items.index(Ellipsis)
        return items[:at] + fill + items[at + 1:]
    return items + fill


def index_dims(items: Any) -> Any:
    """{input dim: (output dim or None, item)} for an expanded basic index."""
    mapping: dict[int, tuple[Optional[int], Any]] = {}
    in_dim, out_dim = 0, 0
    for item in items:
        if item is None:
            out_dim += 1
        elif isinstance(item, slice):
            mapping[in_dim] = (out_dim, item)
            in_dim += 1
            out_dim += 1
        else:
            mapping[in_dim] = (None, item)
            in_dim += 1
    return mapping


def _is_whole(item, size):
    return isinstance(item, slice) and item.indices(size) == (0, size, 1)


@register_rule("getitem")
def getitem_rule(call: Any) -> Any:
    spec = _source(call)
    if spec is None or len(call.args) < 2:
        return None
    items = expand_index(call.args[1], spec.ndim)
    if items is None:
        return None
    mapping = index_dims(items)
    touched = {d for d, (_, item) in mapping.items() if not _is_whole(item, spec.shape[d])}
    inputs, outputs = gather_dims(spec, touched, lambda d: mapping[d][0], partial_stays=True)
    kept = {p.dim for p in inputs if p.is_shard()}
    # the kept sharded dims are whole slices: on the local shard they become plain ':'
    local_items: list[Any] = []
    in_dim = 0
    for item in items:
        if item is None:
            local_items.append(None)
            continue
        local_items.append(slice(None) if in_dim in kept else item)
        in_dim += 1
    local_index = tuple(local_items)

    def index_local_piece(call_, args, kwargs):
        return call_.func(args[0], local_index)
    return OpStrategy(inputs=[inputs], outputs=outputs, local=index_local_piece)


__all__ = ["expand_index", "index_dims"]
