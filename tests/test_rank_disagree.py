"""Ranks that disagree get the same ValueError on every rank before any collective that depends on
the disagreement (issue 23, item 4). The platform-neutral checks are in tests/cases/rank_disagree.py
(torch and MindSpore); here the torch-only ones: the steady state adds no collective, debug mode
checks every call, run_check=True's broadcast is differentiable, and a disagreement on one line of
a 2-D mesh stops every rank.
"""
import pytest

from tests.cases import rank_disagree as neutral
from tests.harness import run_dist
from tests.harness.frameworks import framework_worlds, run_on


@pytest.mark.parametrize("framework,world_size", framework_worlds(2, 4))
def test_from_local_disagreements_raise_everywhere(framework, world_size):
    assert run_on(framework, world_size, neutral.from_local_disagreements, timeout=120) == [True] * world_size


@pytest.mark.parametrize("framework,world_size", framework_worlds(2, 4))
def test_replicate_run_check_and_debug_switch(framework, world_size):
    assert run_on(framework, world_size, neutral.replicate_values, timeout=120) == [True] * world_size


@pytest.mark.parametrize("framework,world_size", framework_worlds(2, 4))
def test_sequence_parallel_uneven_sequence(framework, world_size):
    assert run_on(framework, world_size, neutral.sequence_parallel_uneven, timeout=120) == [True] * world_size


def _steady_state_case(rank, world_size):
    import os

    import torch
    from hyper_parallel import DTensor, init_device_mesh
    from hyper_parallel.core.comm_mode import CommDebugMode
    from hyper_parallel.core.dtensor import Replicate, Shard

    mesh = init_device_mesh("cpu", (world_size,))
    x = torch.arange(6.0).reshape(2, 3) + rank
    shape = (2 * world_size, 3, 7)  # a signature no other case uses: its first call checks
    with CommDebugMode() as first:
        DTensor.from_local(torch.zeros(shape[0] // world_size, 3, 7), mesh, [Shard(0)])
    with CommDebugMode() as later:
        for _ in range(3):
            DTensor.from_local(torch.ones(shape[0] // world_size, 3, 7), mesh, [Shard(0)])
    assert first.get_comm_counts() == {"shape_check": 1}, first.get_comm_counts()
    assert later.get_total_counts() == 0, later.get_comm_counts()  # no collective, no host sync
    os.environ["HP_DTENSOR_DEBUG"] = "1"
    try:
        with CommDebugMode() as debug:
            for _ in range(2):
                DTensor.from_local(torch.ones(shape[0] // world_size, 3, 7), mesh, [Shard(0)])
        assert debug.get_comm_counts() == {"shape_check": 2}, debug.get_comm_counts()
    finally:
        os.environ.pop("HP_DTENSOR_DEBUG", None)

    # run_check=True: rank 0's values, and the gradient reaches each rank's own local tensor
    local = x.clone().requires_grad_()
    with CommDebugMode() as checked:
        dt = DTensor.from_local(local, mesh, [Replicate()], run_check=True)
    assert checked.get_comm_counts().get("shape_check") == 1, checked.get_comm_counts()
    torch.testing.assert_close(dt.to_local(), torch.arange(6.0).reshape(2, 3))
    (dt.to_local() * 3).sum().backward()
    torch.testing.assert_close(local.grad, torch.full((2, 3), 3.0))
    return True


def test_steady_state_adds_no_collective():
    assert run_dist(2, _steady_state_case) == [True, True]


def _mesh_2d_case(rank, world_size):
    import os

    import pytest
    import torch
    from hyper_parallel import DTensor, init_device_mesh
    from hyper_parallel.core.dtensor import Replicate, Shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp, tp = mesh.get_coordinate()
    # Shard over dp, Replicate over tp: only the dp=1 line disagrees (rank 3's value differs)
    x = torch.arange(6.0).reshape(2, 3) + 10 * dp + (0.25 if rank == 3 else 0.0)
    os.environ["HP_DTENSOR_DEBUG"] = "1"
    try:
        with pytest.raises(ValueError, match=r"max difference 0\.25"):
            DTensor.from_local(x, mesh, [Shard(0), Replicate()])  # on the dp=0 line too
        DTensor.from_local(x, mesh, [Shard(0), Shard(1)])  # nothing replicated: nothing to compare
    finally:
        os.environ.pop("HP_DTENSOR_DEBUG", None)
    # a dtype that differs on one rank of a 2-D mesh, default run_check (a shape not used above, so
    # that every rank's signature is new: see test_steady_state_adds_no_collective)
    y = torch.zeros(2, 5, dtype=torch.float16 if rank == 2 else torch.float32)
    with pytest.raises(ValueError, match="dtype float32 vs float16"):
        DTensor.from_local(y, mesh, [Shard(0), Shard(1)]).full_tensor()
    dt = DTensor.from_local(torch.ones(2, 3), mesh, [Shard(0), Shard(1)])
    torch.testing.assert_close(dt.full_tensor(), torch.ones(4, 6))
    return True


def test_disagreement_on_one_line_of_a_2d_mesh_stops_every_rank():
    assert run_dist(4, _mesh_2d_case) == [True] * 4
