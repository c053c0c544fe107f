"""Mesh and lifecycle edges (issue 23, item 6): slicing on a rank outside the mesh, mesh_shape
validation, DTensors used after destroy_process_group, and shard_sequence on the hybrid's 2-D
("ds", "co") mesh, where a rank's block is not its rank order.

The platform-neutral cases live in tests/cases/mesh_edges.py (torch and MindSpore); the
destroy_process_group case is torch-only (it tears down and re-creates a pool's default group).
"""
import pytest

from tests.cases import mesh_edges as cases
from tests.harness import kill_pool, run_dist
from tests.harness.frameworks import FRAMEWORKS, run_on


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_slicing_on_a_rank_outside_the_mesh_raises(framework):
    assert run_on(framework, 4, cases.outside_rank_slicing) == ["member"] * 2 + ["outside"] * 2


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_mesh_shape_is_validated(framework):
    assert run_on(framework, 4, cases.mesh_shape_validation) == [(2, 2)] * 4


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("names", [("ds", "co"), ("co", "ds")])
def test_shard_sequence_on_2d_cp_mesh_equals_one_process(framework, names):
    """(co=c, ds=d) holds block c·ds + d: on ("ds", "co") rank r = 2d + c gets block 2c + d."""
    blocks = run_on(framework, 4, cases.shard_sequence_ds_co, names, (2, 2), {})
    by_rank = [(r % 2) * 2 + r // 2 if names == ("ds", "co") else r for r in range(4)]
    assert blocks == by_rank


def test_shard_sequence_2d_cp_mesh_ring():
    """Ulysses x ring (torch: the ring needs its sdpa kernels) on ("ds", "co")."""
    assert run_dist(4, cases.shard_sequence_ds_co, ("ds", "co"), (2, 2),
                    {"kv_exchange": "ring"}) == [0, 2, 1, 3]


def test_shard_sequence_2d_cp_mesh_load_balance():
    """A ("ds", "co") mesh with ds of size 1 under load balancing (all-gather KV, head-tail): the co
    dim is the CP mesh; shard_sequence's blocks and ContextParallel agree, equal to one device."""
    assert run_dist(4, cases.shard_sequence_ds_co, ("ds", "co"), (1, 4),
                    {"ulysses_degree": 1, "load_balance": True}) == [0, 1, 2, 3]


def _shard_sequence_errors(rank, world_size):
    import torch
    from hyper_parallel import init_device_mesh, shard_sequence
    ids = torch.arange(16).reshape(1, 16)
    # load balance needs ds size 1; there the block is the co coordinate
    one = init_device_mesh("cpu", (1, world_size), mesh_dim_names=("ds", "co"))
    assert torch.equal(shard_sequence(ids, one, load_balance=True), ids[:, 4 * rank:4 * rank + 4])
    with pytest.raises(ValueError, match="ds size 2"):
        shard_sequence(ids, init_device_mesh("cpu", (2, 2), mesh_dim_names=("ds", "co")), load_balance=True)
    with pytest.raises(ValueError, match=r"named \('co', 'ds'\)"):
        shard_sequence(ids, init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp")))
    return True


def test_shard_sequence_2d_mesh_errors():
    assert run_dist(4, _shard_sequence_errors) == [True] * 4


def _init_again(platform, rank, world_size):
    # a fresh rendezvous: on MASTER_PORT again, a rank can meet the first group's store (still
    # alive while the old mesh holds its groups) and read its stale addresses, which hangs the
    # other rank. The parent's pid and the pool's port name this pool's file on both ranks.
    import os
    import tempfile
    path = os.path.join(tempfile.gettempdir(),
                        f"hp-reinit-{os.getppid()}-{os.environ['MASTER_PORT']}")
    platform.init_process_group(init_method=f"file://{path}", rank=rank, world_size=world_size)
    return path


def _after_destroy(rank, world_size):
    import os
    import torch
    from hyper_parallel import Replicate, Shard, distribute_tensor, init_device_mesh
    from hyper_parallel.platform import get_platform
    platform = get_platform()
    mesh = init_device_mesh("cpu", (world_size,))
    dt = distribute_tensor(torch.arange(8.0), mesh, [Shard(0)])
    platform.destroy_process_group()
    try:
        for use in (dt.full_tensor, lambda: dt.redistribute(mesh, [Replicate()]), lambda: mesh.get_group(0)):
            with pytest.raises(RuntimeError, match="process group .* is gone.*destroy_process_group"):
                use()
    finally:
        store_file = _init_again(platform, rank, world_size)
    # initialised again: the old mesh's groups are stale, still a clear error
    with pytest.raises(RuntimeError, match="is gone"):
        dt.full_tensor()
    fresh = distribute_tensor(torch.arange(8.0), init_device_mesh("cpu", (world_size,)), [Shard(0)])
    gathered = fresh.full_tensor().tolist()
    platform.barrier()  # new groups write to the file store: remove it once every rank is done
    if rank == 0:
        os.remove(store_file)
    return gathered


def test_dtensor_after_destroy_process_group_says_the_group_is_gone():
    try:
        assert run_dist(2, _after_destroy) == [list(range(8))] * 2
    finally:
        kill_pool(2)  # the case re-initialised the default group: give later tests a fresh pool
