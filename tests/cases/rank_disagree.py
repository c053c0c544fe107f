"""Ranks that disagree, on any framework: the same ValueError on every rank, never a gloo abort.

- ``DTensor.from_local`` with the DEFAULT ``run_check=False``: a dtype or ndim that differs between
  ranks, and uneven pieces without ``shape=``, are caught on the first call of a signature.
- ``run_check=True`` gives a Replicate piece the first rank's value (as PyTorch broadcasts).
- ``HP_DTENSOR_DEBUG=1`` compares Replicate pieces: a tensor-parallel input that differs per rank
  is a ValueError naming the module and the largest difference.
- ``SequenceParallel`` on a sequence that does not split evenly: a ValueError on every rank.
After each error the ranks are still in step (the next collective works and is exact).
"""
import os

import numpy as np

from tests.frameworks import close, current, expect_error, inp, t

E, F = 4, 6


def _linear_kind():
    """The adapter's Linear flavour: nn.Linear on torch, mint.nn.Linear on MindSpore."""
    return "linear" if type(current()).__name__.startswith("Torch") else "mint"


def _in_step(mesh, what):
    """A collective after an error: every rank must reach it, with buffers of one size."""
    from hyper_parallel import DTensor, Shard
    x = inp("step", 0, (2 * mesh.size(), 3))
    dt = DTensor.from_local(t(x[2 * mesh.get_local_rank(0):2 * mesh.get_local_rank(0) + 2]), mesh, [Shard(0)])
    close(dt.full_tensor(), x, f"in step after {what}")


def from_local_disagreements(rank, world_size):
    """Each scenario uses shapes no earlier call used, so it is the first call of its signature on
    every rank: that is when the default run_check=False checks (HP_DTENSOR_DEBUG=1: every call)."""
    from hyper_parallel import DTensor, Replicate, Shard, init_device_mesh
    mesh = init_device_mesh("cpu", (world_size,))
    odd = world_size - 1                                    # the rank that disagrees

    def piece(cols):
        return inp("piece", rank, (2, cols))
    # dtype (gloo aborted in the first all-gather): caught at from_local, run_check=False
    mine = piece(11).astype(np.float64) if rank == odd else piece(11)
    expect_error(ValueError, lambda: DTensor.from_local(t(mine), mesh, [Shard(0)]),
                 "dtype float32 vs float64", "DTensor.from_local")
    _in_step(mesh, "dtype")
    # ndim (silently accepted: each rank had its own global shape)
    mine = piece(12).reshape(2, 12, 1) if rank == odd else piece(12)
    expect_error(ValueError, lambda: DTensor.from_local(t(mine), mesh, [Shard(0)]), "ndim 2 vs 3")
    _in_step(mesh, "ndim")
    # uneven pieces without shape= (each rank infers another global shape)
    mine = inp("piece", rank, (3 if rank == 0 else 2, 13))
    expect_error(ValueError, lambda: DTensor.from_local(t(mine), mesh, [Shard(0)]), "shape=",
                 f"global dim 0: {2 * world_size} vs {3 * world_size}")
    _in_step(mesh, "uneven")
    # ... and with shape= they are a valid uneven layout
    full = inp("uneven", 0, (2 * world_size - 1, 3))
    rows = [2] * (world_size - 1) + [1]                     # torch.chunk: earlier ranks the larger
    start = sum(rows[:rank])
    dt = DTensor.from_local(t(full[start:start + rows[rank]]), mesh, [Shard(0)], shape=full.shape)
    close(dt.full_tensor(), full, "uneven with shape=")
    # a Shard dim this rank's tensor does not have: every rank raises (not only the 1-D one)
    mine = piece(14)[0] if rank == odd else piece(14)
    expect_error(ValueError, lambda: DTensor.from_local(t(mine), mesh, [Shard(1)]), "ndim")
    _in_step(mesh, "shard dim")
    # placements that differ between ranks
    expect_error(ValueError, lambda: DTensor.from_local(t(piece(15)), mesh,
                                                        [Shard(0) if rank == odd else Replicate()]),
                 "placements")
    _in_step(mesh, "placements")
    return True


def replicate_values(rank, world_size):
    """run_check=True broadcasts Replicate pieces; HP_DTENSOR_DEBUG=1 raises when they differ."""
    from hyper_parallel import (ColwiseParallel, DTensor, Replicate, RowwiseParallel, distribute_tensor,
                                init_device_mesh, parallelize_module)
    fw = current()
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    mine, first = inp("rep", rank, (2, 3)), inp("rep", 0, (2, 3))
    dt = DTensor.from_local(t(mine), mesh, [Replicate()], run_check=True)
    close(dt.to_local(), first, "run_check=True: rank 0's value on every rank")
    close(DTensor.from_local(t(mine), mesh, [Replicate()]).to_local(), mine, "run_check=False keeps it")
    mlp = fw.mlp(_linear_kind(), E, F)
    parallelize_module(mlp, mesh, {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
    os.environ["HP_DTENSOR_DEBUG"] = "1"
    try:
        expect_error(ValueError, lambda: DTensor.from_local(t(mine), mesh, [Replicate()]),
                     "max difference", "HP_DTENSOR_DEBUG")
        x = inp("tpx", 0, (2, E))
        bumped = x + (0.5 if rank == 1 else 0.0)            # one rank's TP input is off by 0.5
        expect_error(ValueError, lambda: mlp(t(bumped.astype(np.float32))), "ColwiseParallel",
                     "max difference 0.5")
        expect_error(ValueError, lambda: distribute_tensor(t(mine), mesh, src_data_rank=None),
                     "max difference")
        out = mlp(t(x))                                     # agreeing inputs pass under debug
        _in_step(mesh, "debug")
    finally:
        os.environ.pop("HP_DTENSOR_DEBUG", None)
    close(mlp(t(x)), fw.numpy(out), "same result without debug")
    return True


def sequence_parallel_uneven(rank, world_size):
    """SequenceParallel: an uneven split is a ValueError on every rank; even splits are exact."""
    from hyper_parallel import SequenceParallel, init_device_mesh, parallelize_module
    fw = current()
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    ref = fw.mlp(_linear_kind(), E, F)
    arrays = {name: inp(f"sp{name}", 0, shape) for name, shape in fw.parameter_shapes(ref).items()}
    fw.set_parameters(ref, arrays)
    model = fw.mlp(_linear_kind(), E, F)
    fw.set_parameters(model, arrays)
    parallelize_module(model, mesh, SequenceParallel(use_local_output=True))
    x = inp("spx", 0, (1, 2 * world_size, E))
    out = model(t(x[:, 2 * rank:2 * rank + 2]))
    close(out, fw.numpy(ref(t(x)))[:, 2 * rank:2 * rank + 2], "SequenceParallel even")
    # 3*world_size + 1 tokens chunked: rank 0 has 4, the others 3 -- lengths no rank has passed before,
    # so every rank checks (the first call of a signature)
    long = inp("spx", 1, (1, 3 * world_size + 1, E))
    mine = long[:, :4] if rank == 0 else long[:, 3 * rank + 1:3 * rank + 4]
    expect_error(ValueError, lambda: model(t(mine)), "SequenceParallel(sequence_dim=1)", "pad the sequence",
                 f"tensor-parallel size {world_size}")
    _in_step(mesh, "SequenceParallel")
    # a rank that repeats an already verified length (2) beside one that does not (1): only debug
    # mode, which checks every call, can tell (the steady state has no collective to notice it)
    os.environ["HP_DTENSOR_DEBUG"] = "1"
    try:
        mine = x[:, :1] if rank == 0 else x[:, 2 * rank - 1:2 * rank + 1]
        expect_error(ValueError, lambda: model(t(mine)), "SequenceParallel(sequence_dim=1)",
                     "pad the sequence")
        _in_step(mesh, "SequenceParallel (debug)")
    finally:
        os.environ.pop("HP_DTENSOR_DEBUG", None)
    return True
