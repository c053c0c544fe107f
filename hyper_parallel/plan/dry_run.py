"""``dry_run``: one training step of one rank of an N-rank job, in this process, on fake tensors.

The step is the library's real path: ``parallelize_model`` (tensor parallel, context parallel,
fully_shard, chunked loss), ``tiled_mlp``, Hugging Face's activation checkpointing, an AdamW step.
Three steps run; the third is measured (the first two do what happens once: cross-rank agreement
checks, the optimizer's state; see ``measure``). What cannot be known without values is assumed, at
the few places that read values on the host (``platform.is_fake``): ranks agree, labels are in range,
one unpadded document per sequence, and MoE routing is balanced (expert_parallel/dispatch.py:
assignment i to expert i mod E on every rank).
"""
import math
import types
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterable, Optional, Sequence, Tuple

from hyper_parallel.core.arguments import check_int
from hyper_parallel.core.comm_mode import CommDebugMode
from hyper_parallel.core.dtensor.device_mesh import DeviceMesh
from hyper_parallel.plan.options import FEATURES, cp_kwargs, check_features
from hyper_parallel.plan.report import DryRunReport
from hyper_parallel.platform import get_platform, reset_platform

if TYPE_CHECKING:   # torch's side, imported only when a dry run starts (torch_tools)
    from hyper_parallel.platform.torch.dry_run import TrainStep

MESH_DIMS = ("dp_replicate", "dp_shard", "cp", "tp")


def torch_tools() -> types.ModuleType:
    """The torch side (platform/torch/dry_run.py); a clear error on any other platform."""
    name = get_platform().name
    if name not in ("torch", "npu"):
        raise RuntimeError(f"hyper_parallel.plan: the dry run needs PyTorch's FakeTensorMode and fake "
                           f"process "
                           f"group; HP_PLATFORM={name} has no fake tensors. Run it with HP_PLATFORM=torch "
                           f"(the plan applies to the same model on any platform)")
    from hyper_parallel.platform.torch import dry_run as tools
    return tools


def check_mesh(mesh_shape: Sequence[int], mesh_dim_names: Sequence[str]) -> Dict[str, int]:
    if len(mesh_shape) != len(mesh_dim_names):
        raise ValueError(f"dry_run: mesh_shape {tuple(mesh_shape)} and mesh_dim_names "
                         f"{tuple(mesh_dim_names)} "
                         f"differ in length")
    unknown = [n for n in mesh_dim_names if n not in MESH_DIMS + ("ep",)]
    if unknown or len(set(mesh_dim_names)) != len(mesh_dim_names):
        raise ValueError(f"dry_run: mesh dims {list(mesh_dim_names)}: each must be one of {MESH_DIMS}, once")
    for size in mesh_shape:   # 2.5 or True must not pass as 2 or 1
        check_int("dry_run", "mesh_shape", size, minimum=1, fix="give every mesh size as an int >= 1")
    if "ep" in mesh_dim_names:
        # this library's experts split over data-parallel dims (SPEC §17): ep names them
        raise ValueError("dry_run: expert parallelism runs over the data-parallel ranks here, not a mesh dim "
                         "of its own: drop 'ep' from the mesh and pass ep='dp_shard' (or "
                         "ep=('dp_shard', 'cp')); "
                         "the CLI's --ep dp_shard[,cp]")
    sizes = dict(zip(mesh_dim_names, (int(s) for s in mesh_shape)))
    if "cp" not in sizes:
        # a cp dim of size 1 (no collective): attention then goes through the library's CP attention
        # function, whose masks are never materialised; Hugging Face's own sdpa path cannot tell on fake
        # tensors that a mask is all-causal and would build an S x S one the real run skips
        names = list(sizes)
        at = names.index("tp") if "tp" in names else len(names)
        sizes = dict(list(sizes.items())[:at] + [("cp", 1)] + list(sizes.items())[at:])
    return sizes


def _apply_features(model, features, tiled_chunks):
    from hyper_parallel.core.long_sequence.tiled_mlp import tiled_mlp
    from hyper_parallel.integrations.hf_fully_shard import decoder_layers
    if "checkpoint" in features:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if "tiled_mlp" in features:
        for layer in decoder_layers(model):
            tiled_mlp(layer.mlp, tiled_chunks)


def _parallelize(model, mesh, sizes, cp_mode, features, parallel_options):
    from hyper_parallel.core.data_parallel import data_parallel
    from hyper_parallel.integrations.transformers import parallelize_model
    options = dict(parallel_options)
    policy = _mixed_precision(options, sizes)
    if "chunked_loss" in features:
        options["loss"] = "chunked"
    names = [n for n in sizes if sizes[n] > 1 or n in ("cp", "tp", "dp_shard")]
    if sizes.get("cp", 1) > 1:
        options.update(cp_kwargs(cp_mode))
    if any(n in sizes for n in ("cp", "tp", "dp_shard")):
        average = options.pop("average", "dp_shard" not in sizes or "cp" not in sizes)
        average = average if "dp_shard" in sizes else True
        if policy is not None:
            # parallelize_model takes no MixedPrecisionPolicy (SPEC §11 / §16): its fully_shard step is
            # done here as hf_fully_shard does it (each decoder layer, then the root), with the policy
            options["dp_shard"] = None
        parallelize_model(model, mesh, average=average if policy is None else True, **options)
        if policy is not None:
            from hyper_parallel.core.fully_shard import fully_shard
            from hyper_parallel.integrations.hf_fully_shard import decoder_layers, shard_mesh
            sharding = shard_mesh(mesh, "dp_shard", "cp" if sizes.get("cp", 1) > 1 else None)
            for layer in decoder_layers(model):
                fully_shard(layer, sharding, average=average, mp_policy=policy)
            fully_shard(model, sharding, average=average, mp_policy=policy)
    if "dp_shard" not in sizes:
        # replicated data parallel over the ranks that see different tokens (dp_replicate x cp)
        data_dims = [n for n in ("dp_replicate", "cp") if sizes.get(n, 1) > 1]
        if data_dims:
            sub = mesh[data_dims[0]] if len(data_dims) == 1 else mesh[tuple(data_dims)].flatten()
            data_parallel(model, sub)
    return names


def _mixed_precision(options, sizes):
    """fully_shard's MixedPrecisionPolicy from ``param_dtype=`` / ``reduce_dtype=`` (dtype names): the
    model's own dtype is the master weights' (fp32), gathered parameters and compute in param_dtype,
    gradients reduced in reduce_dtype (default param_dtype, as FSDP2). None without them."""
    param, reduce = options.pop("param_dtype", None), options.pop("reduce_dtype", None)
    if param is None and reduce is None:
        return None
    if "dp_shard" not in sizes or options.get("ep") is not None:
        raise ValueError(f"dry_run(param_dtype={param!r}, reduce_dtype={reduce!r}): mixed precision is "
                         f"fully_shard's policy; it needs a dp_shard mesh dim and no ep= here (the experts' "
                         f"own fully_shard takes no policy through parallelize_model)")
    from hyper_parallel.core.fully_shard import MixedPrecisionPolicy
    dtype = torch_tools().dtype
    return MixedPrecisionPolicy(param_dtype=dtype(param), reduce_dtype=dtype(reduce))


def _dim_labels(mesh, names):
    """frozenset(ranks) of this rank's line along each set of mesh dims -> a label (``cp``,
    ``dp_shard+cp``); single dims first, so a group of one dim is named by it."""
    import itertools
    import numpy as np
    grid = np.asarray(mesh.rank_list).reshape(mesh.mesh_shape)
    me = mesh.get_coordinate()
    labels = {}
    for k in range(1, len(names) + 1):
        for dims in itertools.combinations(range(len(names)), k):
            index = tuple(slice(None) if d in dims else me[d] for d in range(len(names)))
            ranks = frozenset(int(r) for r in np.asarray(grid[index]).reshape(-1))
            labels.setdefault(ranks, "+".join(names[d] for d in dims))
    return labels


def comm_by_dim(log: Iterable[Tuple[str, int, Sequence[int]]], mesh: DeviceMesh,
                names: Sequence[str]) -> Dict[str, dict]:
    labels = _dim_labels(mesh, names)
    out: dict[Any, Any] = {}
    cp = "cp" in names and mesh["cp"].size() > 1
    for op, nbytes, ranks in log:
        dim = labels.get(frozenset(ranks), "world" if len(ranks) == mesh.size() else "other")
        if op == "send_recv" and cp:
            # point-to-point runs on the default group with the peers' global ranks; its only users
            # (the ring, linear attention's state hand-over) pass blocks between CP neighbours
            dim = "cp"
        entry = out.setdefault(dim, {"collectives": 0, "bytes_sent": 0, "bytes_received": 0, "ops": {}})
        entry["collectives"] += 1
        entry["bytes_sent"] += nbytes
        # the library's patterns are symmetric: what a rank sends on a line it also receives
        entry["bytes_received"] += nbytes
        count, total = entry["ops"].get(op, (0, 0))
        entry["ops"][op] = (count + 1, total + nbytes)
    return out


def dry_run(model_fn: Callable, mesh_shape: Sequence[int], mesh_dim_names: Sequence[str], *, rank: int = 0,
            seq_len: int, batch: int = 1, cp_mode: Optional[str] = None, features: Sequence[str] = (),
            tiled_mlp_chunks: int = 4, model_name: Optional[str] = None,
            **parallel_options: Any) -> DryRunReport:
    """One training step of rank ``rank`` of a ``prod(mesh_shape)``-rank job on fake tensors.
    ``model_fn()`` builds the model (called on the meta device). ``seq_len``: tokens per sequence
    (split over ``cp``); ``batch``: sequences per data-parallel rank. ``cp_mode``: ulysses,
    allgather, allgather_lb, ring or zigzag; ``features``: chunked_loss, tiled_mlp, checkpoint.
    Other keyword arguments go to ``parallelize_model``."""
    tools = torch_tools()
    sizes = check_mesh(mesh_shape, mesh_dim_names)
    check_features(features, cp_mode, sizes)
    for name, value in (("seq_len", seq_len), ("batch", batch), ("rank", rank)):
        check_int("dry_run", name, value)   # 16.0, 1.5, inf: a ValueError, not torch's TypeError later
    if seq_len % max(1, sizes.get("cp", 1)) or seq_len < 1 or batch < 1:
        raise ValueError(f"dry_run: seq_len {seq_len} must be a positive multiple of cp={sizes.get('cp', 1)} "
                         f"and batch {batch} positive")
    world = math.prod(sizes.values())
    reset_platform()
    try:
        with tools.FakeWorld(rank, world) as fake_world:
            return _run(tools, fake_world, model_fn, sizes, seq_len, batch, cp_mode, tuple(features),
                        tiled_mlp_chunks, model_name, parallel_options)
    finally:
        reset_platform()


def _run(tools, fake_world, model_fn, sizes, seq_len, batch, cp_mode, features, chunks, name, options):
    import time
    from hyper_parallel.core.dtensor.device_mesh import init_device_mesh
    start = time.perf_counter()
    mesh = init_device_mesh("cpu", tuple(sizes.values()), mesh_dim_names=tuple(sizes))
    with tools.meta_device():
        model = model_fn()
    report = _step_report(tools, model, mesh, sizes, seq_len, batch, cp_mode, features, chunks, options,
                          fake_world.fake, name, fake_world.rank)
    report.wall_seconds = time.perf_counter() - start
    return report


def real_run(model_fn: Callable, mesh_shape: Sequence[int], mesh_dim_names: Sequence[str], *, seq_len: int,
             batch: int = 1, cp_mode: Optional[str] = None, features: Sequence[str] = (),
             tiled_mlp_chunks: int = 4, model_name: Optional[str] = None,
             **parallel_options: Any) -> DryRunReport:
    """The same step for real, in a job already started (each rank calls it): the yardstick the
    tests hold the dry run to. The model is built on meta and each rank's pieces allocated (zeros)."""
    tools = torch_tools()
    from hyper_parallel.core.dtensor.device_mesh import init_device_mesh
    sizes = check_mesh(mesh_shape, mesh_dim_names)
    check_features(features, cp_mode, sizes)
    mesh = init_device_mesh("cpu", tuple(sizes.values()), mesh_dim_names=tuple(sizes))
    with tools.meta_device():   # as at scale: built on meta, each rank allocates its own pieces
        model = model_fn()
    return _step_report(tools, model, mesh, sizes, seq_len, batch, cp_mode, tuple(features), tiled_mlp_chunks,
                        parallel_options, None, model_name or type(model).__name__, get_platform().get_rank())


def _step_report(tools, model, mesh, sizes, seq_len, batch, cp_mode, features, chunks, options, fake, name,
                 rank):
    import warnings
    from hyper_parallel.core.data_parallel.shard_sequence import shard_sequence
    _apply_features(model, features, chunks)
    _parallelize(model, mesh, sizes, cp_mode, features, options)
    cp_mesh = mesh["cp"] if sizes.get("cp", 1) > 1 else None
    step = tools.TrainStep(model, seq_len, batch, cp_mesh=cp_mesh, fake=fake)
    with warnings.catch_warnings():
        # the mixed-precision path applies fully_shard after parallelize_model, whose first-forward
        # check would call the dp dims unreduced; every dim is reduced here (fully_shard / data_parallel)
        warnings.filterwarnings("ignore", message="parallelize_model: the gradients are reduced over no")
        return measure(step, shard_sequence, mesh, sizes, name, seq_len, batch,
                       cp_mode if cp_mesh is not None else None, features, rank)


def measure(step: "TrainStep", shard_sequence: Callable[..., Any], mesh: DeviceMesh,
            sizes: Dict[str, int], name: str, seq_len: int, batch: int, cp_mode: Optional[str],
            features: Sequence[str], rank: int, warmups: int = 2) -> DryRunReport:
    """The steady-state step (memory, FLOPs, collectives), fake or real alike, after ``warmups``
    steps, which do what happens once (cross-rank agreement checks, the optimizer's state). Two: the
    agreement schedule learns the order of fully_shard's unit calls across steps (the transition from
    the last layer to the next step's root) in the second step of a dry run, where a real run has
    already seen it in its context-parallel audit's forwards (which read values; a dry run skips it)."""
    tools = torch_tools()
    for _ in range(warmups):
        step.run(shard_sequence)
        step.zero_grad()
    tracker = tools.StepTracker()
    tracker.adopt(step.parameters() + step.optimizer_state())
    with CommDebugMode() as comm:
        seconds = step.run(shard_sequence, tracker)
    memory = tracker.breakdown(step.parameters(), step.gradients(), step.optimizer_state())
    step.zero_grad()
    return DryRunReport(model=name, mesh=dict(sizes), rank=rank, seq=seq_len, batch=batch, cp_mode=cp_mode,
                        features=list(features), memory_bytes=memory, peak_memory_bytes=tracker.peak_bytes,
                        flops=tracker.flops, comm=comm_by_dim(comm.log, mesh, list(sizes)),
                        memory_bound_bytes=tracker.memory_bound_bytes,
                        ops=dict(tracker.ops), step_wall_seconds=seconds, op_count=tracker.op_count)


__all__ = ["dry_run", "real_run", "DryRunReport", "FEATURES"]
