"""shard_sequence: this rank's block of each per-token tensor, in the layout ContextParallel expects.

Context parallelism splits every per-token tensor of a batch (input ids, position ids, labels,
padding masks) along the sequence. Labels must be shifted on the **whole** sequence before
sharding (``labels[:, t] = input_ids[:, t + 1]``, the last one ignored), because the token after
a rank's last token lives on the next rank.

Layout. ``ContextParallel`` takes **contiguous** blocks in every mode, with ``load_balance=True``
too: its head-tail balancing (rank r computes chunks 2r and 2P-1-2r of 2P) is an internal,
differentiable exchange of half-blocks with the partner rank P-1-r, and outputs come back in the
contiguous layout (see hyper_parallel/core/context_parallel/load_balance.py). Handing it head-tail
chunks would apply the causal mask to the wrong tokens. So ``load_balance=True`` returns the same
contiguous blocks and only checks what the balanced path needs: the sequence splits into 2·P
equal chunks.

2-D meshes. The hybrid (Ulysses x all-gather / ring) runs on a mesh named ``("co", "ds")`` in either
order, used by name: the rank at (co=c, ds=d) holds block ``c·ds + d``. On a ``("ds", "co")`` mesh
that is not the rank's position in the mesh's rank order, so splitting by rank (or by
``get_local_rank(0)``) hands ranks the wrong blocks, silently. This function reads the block from
the names, exactly as ContextParallel does.

Loss normalisation. Give each rank the loss ``sum of its token losses / global token count``
(the count of non-ignored labels over every rank of the data-parallel × context-parallel mesh).
The per-rank losses then add up to the global mean loss, and ``data_parallel(model, mesh,
average=False)`` — a sum — gives every rank exactly the gradient of the single-device mean loss,
whatever the number of padded or ignored tokens per rank. (With ``average=True`` and a per-rank
mean loss, the result is exact only when every rank holds the same number of counted tokens.)
"""
from hyper_parallel.core.arguments import check_int
from hyper_parallel.core.dtensor.device_mesh import DeviceMesh


def _block_index(mesh, load_balance):
    """This rank's block among ``mesh.size()``: the position ContextParallel gives it (style.py's
    ``_cp_mesh``): its rank on a 1-D mesh, ``co·ds_size + ds`` on a 2-D (co, ds) mesh."""
    if mesh.ndim == 1:
        return mesh.get_local_rank(0)
    names = mesh.mesh_dim_names
    if mesh.ndim != 2 or names is None or sorted(names) != ["co", "ds"]:
        raise ValueError(f"shard_sequence needs a 1-D context-parallel DeviceMesh (e.g. mesh['cp']) or a 2-D "
                         f"one named ('co', 'ds') in either order (the hybrid's mesh), got {mesh!r}")
    if load_balance and mesh.size("ds") != 1:
        raise ValueError(f"shard_sequence(load_balance=True) on a ('co', 'ds') mesh with ds size "
                         f"{mesh.size('ds')}: ContextParallel balances only with ulysses_degree=1 (ds size 1); "
                         f"set load_balance=False or use a ds size of 1")
    return mesh.get_local_rank("co") * mesh.size("ds") + mesh.get_local_rank("ds")


def _block(tensor, mesh, seq_dim, load_balance, index):
    parts = mesh.size()
    dim = seq_dim % tensor.ndim if -tensor.ndim <= seq_dim < tensor.ndim else None
    if dim is None:
        raise ValueError(f"shard_sequence: seq_dim={seq_dim} is out of range for a {tensor.ndim}-D tensor "
                         f"of shape {tuple(tensor.shape)}")
    length = tensor.shape[dim]
    chunks = 2 * parts if load_balance else parts
    if length % chunks:
        need = f"2 x the context-parallel size ({chunks})" if load_balance else f"the mesh size ({parts})"
        raise ValueError(f"shard_sequence: sequence length {length} (dim {dim} of shape "
                         f"{tuple(tensor.shape)}) is not divisible by {need}; pad the batch to a "
                         f"multiple of {chunks}")
    size = length // parts
    return tensor.narrow(dim, index * size, size).contiguous()


def shard_sequence(tensors, device_mesh, seq_dim=1, load_balance=False):
    """This rank's sequence block of ``tensors`` (a tensor, or a list/tuple of them; the same
    structure is returned) on the context-parallel ``device_mesh``: 1-D, or the hybrid's 2-D mesh
    named ``("co", "ds")`` in either order (the rank at (co=c, ds=d) gets block ``c·ds + d``).

    ``load_balance`` states that the attention uses ``ContextParallel(load_balance=True)``: the
    blocks are the same contiguous ones (the balancing exchange is inside the style) and the length
    must divide by 2·P. ``None`` entries pass through unchanged."""
    if not isinstance(device_mesh, DeviceMesh):
        raise ValueError(f"shard_sequence needs a context-parallel DeviceMesh (e.g. mesh['cp']), got "
                         f"{device_mesh!r}")
    check_int("shard_sequence", "seq_dim", seq_dim, fix="the sequence dim of the tensors (1: (batch, seq, ...))")
    index = _block_index(device_mesh, load_balance)
    if isinstance(tensors, (list, tuple)):
        out = [None if t is None else _block(t, device_mesh, seq_dim, load_balance, index) for t in tensors]
        if isinstance(tensors, list):
            return out
        if hasattr(tensors, "_fields"):  # a namedtuple
            return type(tensors)(*out)
        return type(tensors)(out)
    return _block(tensors, device_mesh, seq_dim, load_balance, index)
