"""fully_shard inside ``parallelize_model(..., dp_shard="dp_shard")``: each decoder layer, then the root.

The sharding mesh is the ``dp_shard`` dim; with a ``cp`` dim it is the flattened (dp_shard, cp)
mesh, because context-parallel ranks see different tokens and their gradients must be reduced too
(torchtitan's dp_shard_cp); with a ``dp_replicate`` dim (and no cp) it is the 2-D HSDP mesh.
"""
from typing import Any
import warnings

from hyper_parallel.core.fully_shard import fully_shard
from hyper_parallel.platform import get_platform


def shard_mesh(mesh: Any, dp_shard: Any, cp: Any) -> Any:
    """The mesh fully_shard shards over (see the module docstring). A size-1 ``cp`` or
    ``dp_replicate`` dim is left out: it changes nothing, and the examples' meshes always name them."""
    names = tuple(mesh.mesh_dim_names or ())
    if mesh.ndim == 1:
        return mesh
    if cp is not None and mesh[cp].size() == 1:
        cp = None
    if "dp_replicate" in names and mesh["dp_replicate"].size() == 1:
        names = tuple(n for n in names if n != "dp_replicate")
    if cp is not None:
        if "dp_replicate" in names:
            raise ValueError(f"parallelize_model: a mesh with dims {names} has dp_replicate, {dp_shard!r} "
                             f"and {cp!r}: HSDP with context parallelism is not supported here; fold "
                             f"dp_replicate into {dp_shard!r}, or apply fully_shard yourself")
        return mesh[dp_shard, cp].flatten(f"{dp_shard}_{cp}")
    if "dp_replicate" in names:
        if dp_shard != "dp_shard":
            raise ValueError(f"parallelize_model: HSDP needs the shard dim named 'dp_shard', got "
                             f"{dp_shard!r}")
        return mesh["dp_replicate", "dp_shard"]
    return mesh[dp_shard]


def decoder_layers(model: Any) -> Any:
    """The model's decoder layers: the outermost modules of the classes transformers keeps whole
    (``_no_split_modules``: LlamaDecoderLayer, GPT2Block, ...), else the ``layers`` module list."""
    platform = get_platform()
    whole = set(getattr(model, "_no_split_modules", None) or ())
    found: list[Any] = []
    prefixes: list[Any] = []
    for name, module in platform.named_modules(model):
        if name and type(module).__name__ in whole and not any(name.startswith(p) for p in prefixes):
            found.append(module)
            prefixes.append(name + ".")
    if found:
        return found
    for name, module in platform.named_modules(model):
        if name.split(".")[-1] == "layers" and hasattr(module, "__len__") and len(module):
            return list(module)
    raise ValueError(f"parallelize_model(dp_shard=...): {type(model).__name__} names no decoder-layer class "
                     f"(_no_split_modules) and has no 'layers' module list to shard layer by layer; apply "
                     f"hyper_parallel.fully_shard to its blocks yourself")


def apply_fully_shard(model: Any, mesh: Any, dp_shard: Any, cp: Any, average: bool = True) -> Any:
    """fully_shard each decoder layer, then the whole model, over ``shard_mesh(...)``; ``average``
    as fully_shard's (False for a loss already normalised by the global token count)."""
    sharding = shard_mesh(mesh, dp_shard, cp)
    for layer in decoder_layers(model):
        fully_shard(layer, sharding, average=average)
    fully_shard(model, sharding, average=average)
    return model


def warn_unreduced_dims(model: Any, mesh: Any, reduced: set) -> None:
    """Mesh dims of size > 1 over which nothing parallelize_model applied reduces the gradients
    (``reduced``: the dims its wrappers cover): the ranks along them hold replicas that drift apart
    unless the user wraps the model in ``data_parallel`` over them. Checked at the first forward,
    when that call has had its chance: a warning there names the dims and the fix."""
    names = tuple(mesh.mesh_dim_names or ())
    dims = [n for n in names if n not in reduced and (mesh.size() if mesh.ndim == 1 else mesh[n].size()) > 1]
    if not dims:
        return
    handle = [None]

    def check(module, args):
        handle[0].remove()
        reducer = getattr(model, "_hp_grad_reducer", None)
        covered = set(reducer.mesh.rank_list) if reducer is not None and hasattr(reducer, "mesh") else set()
        missing = [d for d in dims if not set((mesh if mesh.ndim == 1 else mesh[d]).rank_list) <= covered]
        if missing:
            fix = (f"mesh[{missing[0]!r}]" if len(missing) == 1 else
                   f"mesh[{', '.join(map(repr, missing))}].flatten()")
            warnings.warn(f"parallelize_model: the gradients are reduced over no wrapper on mesh dim(s) "
                          f"{missing}: the ranks along them hold replicas of the parameters that will drift "
                          f"apart. Wrap the model: data_parallel(model, {fix}) after parallelize_model (or "
                          f"name the data dim 'dp_shard' to shard it with fully_shard)", UserWarning,
                          stacklevel=2)
    handle[0] = get_platform().register_forward_pre_hook(model, check)
