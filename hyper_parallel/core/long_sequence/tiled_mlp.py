"""``tiled_mlp(module, chunks)``: a block's MLP in sequence tiles, each recomputed in backward.

An MLP is token-local, so running it on sequence tiles gives the same output. What changes is
memory: the up/gate projections make (tokens × intermediate) activations, several times the
block's input, and autograd keeps them for backward. Each tile runs under activation
checkpointing (the platform's ``recompute``): only the tile's input is kept, the tile's
intermediates live only while that tile runs, in forward and again in backward. Intermediate
memory drops from O(S · I) to O(S / chunks · I); the price is one more MLP forward.

Tiles of a DTensor input are taken in its global order (DTensor slicing). A module that receives
a DTensor and returns this rank's *local* shard of each tile (tensor parallelism with sequence
parallel: ``RowwiseParallel(output_layouts=Shard(1))``) gives per tile a piece of that tile, not
of the sequence; the pieces are put back into the sequence's layout through the DTensor (one
redistribution of the output), never concatenated as they come.
"""
from hyper_parallel.core.typing import Module
import inspect

from hyper_parallel.core.arguments import check_int
from hyper_parallel.platform import get_platform

__all__ = ["tiled_mlp"]


def _check(module, chunks, seq_dim):
    check_int("tiled_mlp", "chunks", chunks, minimum=1, fix="the number of sequence tiles, e.g. 8")
    check_int("tiled_mlp", "seq_dim", seq_dim, fix="the index of the sequence dim (1: (batch, seq, hidden))")
    if getattr(module, "_hp_tiled_mlp", False):
        raise ValueError(f"tiled_mlp: {type(module).__name__} is already tiled; apply tiled_mlp once")


def _tile_bounds(length, chunks):
    """torch.chunk's split of ``length`` into at most ``chunks`` tiles: (start, end) pairs."""
    step = -(-length // chunks) if length else 1
    return [(s, min(s + step, length)) for s in range(0, length, step)]


def _input_name(original):
    """The name of the forward's first parameter, so that ``mlp(hidden_states=x)`` tiles ``x`` too."""
    try:
        params = list(inspect.signature(original).parameters.values())
    except (TypeError, ValueError):
        return None
    first = params[0] if params else None
    return first.name if first is not None and first.kind in (first.POSITIONAL_ONLY,
                                                              first.POSITIONAL_OR_KEYWORD) else None


def _is_dtensor(x):
    return hasattr(x, "device_mesh")


def _join_local_shards(pieces, x, dim, tiles):
    """Each piece is this rank's shard (on dim) of a tile's output: rebuild the whole output as a
    DTensor on x's mesh, then give back this rank's shard of the sequence (not of each tile)."""
    from hyper_parallel.core.dtensor.layout import chunk_range
    from hyper_parallel.core.dtensor.placement_types import Shard
    mesh = x.device_mesh
    if mesh.ndim != 1:
        raise ValueError(f"tiled_mlp: the module received a DTensor on a {mesh.ndim}-D mesh and returned a "
                         f"local shard of each tile; the mesh dim it is sharded on is ambiguous. Apply "
                         f"tiled_mlp to a module that returns a DTensor (use_local_output=False) or takes "
                         f"plain tensors")
    size, rank = mesh.size(0), mesh.get_local_rank(0)
    platform = get_platform()
    whole = []
    for piece, (start, end) in zip(pieces, tiles):
        length = end - start
        if piece.shape[dim] != chunk_range(0, length, size, rank)[1]:
            raise ValueError(f"tiled_mlp: a tile of {length} tokens gave an output of {piece.shape[dim]} "
                             f"along dim {dim} on this rank, which is neither the tile nor its shard over "
                             f"the {size} ranks of the input's mesh; tiles cannot be joined")
        shape = tuple(piece.shape[:dim]) + (length,) + tuple(piece.shape[dim + 1:])
        whole.append(type(x).from_local(piece, mesh, [Shard(dim)], shape=shape))
    joined = platform.cat(whole, dim=dim)
    return joined.redistribute(mesh, [Shard(dim)]).to_local()


def _join(outputs, x, dim, tiles, where="output"):
    """Concatenate the tiles' outputs (tensors, None, or tuples / lists of them) in sequence order."""
    platform = get_platform()
    first = outputs[0]
    if first is None:
        if any(o is not None for o in outputs):
            raise ValueError(f"tiled_mlp: {where} is None for some tiles only; tiles cannot be joined")
        return None
    if isinstance(first, (tuple, list)):
        return type(first)(_join([o[i] for o in outputs], x, dim, tiles, f"{where}[{i}]")
                           for i in range(len(first)))
    if not platform.is_tensor(first):
        raise ValueError(f"tiled_mlp: {where} is a {type(first).__name__}; the module must return tensors "
                         f"(or tuples of them) to be run in sequence tiles")
    lengths = [end - start for start, end in tiles]
    lead = tuple(x.shape[:dim])
    if len(first.shape) > dim and all(tuple(o.shape[:dim]) == lead and o.shape[dim] == n
                                      for o, n in zip(outputs, lengths)):
        return platform.cat(list(outputs), dim=dim)
    # (batch * tile, ...) outputs, e.g. a router's logits: join per batch row, flatten back
    if lead and all(len(o.shape) >= 1 and o.shape[0] == _prod(lead) * n for o, n in zip(outputs, lengths)):
        rows = [o.reshape(lead + (n,) + tuple(o.shape[1:])) for o, n in zip(outputs, lengths)]
        return platform.cat(rows, dim=dim).reshape((-1,) + tuple(first.shape[1:]))
    if _is_dtensor(x) and not _is_dtensor(first) and len(first.shape) > dim:
        return _join_local_shards(outputs, x, dim, tiles)
    raise ValueError(f"tiled_mlp: {where} has shape {tuple(first.shape)} for a tile of shape "
                     f"{lead + (lengths[0],)}...; it is neither (..., tile, ...) along dim {dim} nor "
                     f"(batch * tile, ...), so the tiles cannot be joined")


def _prod(values):
    out = 1
    for v in values:
        out *= int(v)
    return out


def _take_input(args, kwargs, name, module):
    """(x, a function of one tile that calls the original with every other argument unchanged)."""
    if args:
        return args[0], (lambda original, tile: original(tile, *args[1:], **kwargs))
    if name is not None and name in kwargs:
        rest = {k: v for k, v in kwargs.items() if k != name}
        return kwargs[name], (lambda original, tile: original(**{name: tile}, **rest))
    raise ValueError(f"tiled_mlp: {type(module).__name__} was called without its input (the first "
                     f"argument{'' if name is None else ' ' + repr(name)}); pass the hidden states "
                     f"positionally or by that name")


def tiled_mlp(module: Module, chunks: int, *, seq_dim: int = 1) -> Module:
    """Make ``module`` (a block's MLP or MoE block: token-local, its first argument (..., seq, ...,
    hidden)) run on ``chunks`` tiles of dim ``seq_dim`` with recompute. Exact: the same values and
    gradients. Returns ``module``. Other arguments pass to every tile unchanged; the input may be
    given positionally or by its name."""
    _check(module, chunks, seq_dim)

    def make_wrapper(original):
        name = _input_name(original)

        def forward(*args, **kwargs):
            x, call = _take_input(args, kwargs, name, module)
            if not get_platform().is_tensor(x) or not -len(x.shape) <= seq_dim < len(x.shape):
                raise ValueError(f"tiled_mlp(seq_dim={seq_dim}): the input is "
                                 f"{tuple(getattr(x, 'shape', ())) or type(x).__name__}; pass a tensor "
                                 f"with a dim {seq_dim}")
            dim = seq_dim % len(x.shape)
            tiles = _tile_bounds(x.shape[dim], chunks)
            if len(tiles) <= 1:
                return call(original, x)
            platform = get_platform()
            index = (slice(None),) * dim
            run = (lambda tile: call(original, tile))
            outputs = []
            for start, end in tiles:
                # a copy, not a view: MoE blocks .view() the tile and some scale it in place
                tile = x[index + (slice(start, end),)].contiguous()
                # under no_grad there is nothing to keep, so nothing to recompute
                outputs.append(platform.recompute(run, tile) if platform.is_grad_enabled() else run(tile))
            return _join(outputs, x, dim, tiles)
        return forward
    get_platform().replace_forward(module, make_wrapper)
    module._hp_tiled_mlp = True
    return module
