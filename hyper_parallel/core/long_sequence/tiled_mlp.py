"""``tiled_mlp(module, chunks)``: a block's MLP in sequence tiles, each recomputed in backward.

An MLP is token-local, so running it on sequence tiles gives the same output. What changes is
memory: the up/gate projections make (tokens × intermediate) activations, several times the
block's input, and autograd keeps them for backward. Each tile runs under activation
checkpointing (the platform's ``recompute``): only the tile's input is kept, the tile's
intermediates live only while that tile runs, in forward and again in backward. Intermediate
memory drops from O(S · I) to O(S / chunks · I); the price is one more MLP forward.
"""
from hyper_parallel.platform import get_platform

__all__ = ["tiled_mlp"]


def _check(module, chunks, seq_dim):
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"tiled_mlp(chunks={chunks!r}): pass a positive int (the number of sequence tiles)")
    if isinstance(seq_dim, bool) or not isinstance(seq_dim, int):
        raise ValueError(f"tiled_mlp(seq_dim={seq_dim!r}): pass the int index of the sequence dim (1 for "
                         f"(batch, seq, hidden))")
    if getattr(module, "_hp_tiled_mlp", False):
        raise ValueError(f"tiled_mlp: {type(module).__name__} is already tiled; apply tiled_mlp once")


def _tile_bounds(length, chunks):
    """torch.chunk's split of ``length`` into at most ``chunks`` tiles: (start, end) pairs."""
    step = -(-length // chunks) if length else 1
    return [(s, min(s + step, length)) for s in range(0, length, step)]


def tiled_mlp(module, chunks, *, seq_dim=1):
    """Make ``module`` (a block's MLP: token-local, its first argument (..., seq, ..., hidden)) run on
    ``chunks`` tiles of dim ``seq_dim`` with recompute. Exact: the same values and gradients. Returns
    ``module``. Other arguments pass to every tile unchanged."""
    _check(module, chunks, seq_dim)

    def make_wrapper(original):
        def forward(x, *args, **kwargs):
            dim = seq_dim % len(x.shape)
            bounds = _tile_bounds(x.shape[dim], chunks)
            if len(bounds) <= 1:
                return original(x, *args, **kwargs)
            platform = get_platform()
            index = (slice(None),) * dim
            run = (lambda tile: original(tile, *args, **kwargs))
            outputs = []
            for start, end in bounds:
                tile = x[index + (slice(start, end),)]
                # under no_grad there is nothing to keep, so nothing to recompute
                outputs.append(platform.recompute(run, tile) if platform.is_grad_enabled() else run(tile))
            return platform.cat(outputs, dim=dim)
        return forward
    get_platform().replace_forward(module, make_wrapper)
    module._hp_tiled_mlp = True
    return module
