"""Ranks that disagree, and ranks outside a mesh: a ValueError on every rank, or PyTorch's no-op.

- ``from_local(run_check=True)`` and ``distribute_tensor`` compare ndim, dtype and shape across
  ranks with one fixed-length message, so a rank with another ndim or dtype raises the same
  ValueError as the others instead of aborting inside gloo.
- A mesh that does not contain this rank: ``get_coordinate()`` is None, slicing it is a ValueError, and
  distribute_tensor / from_local / redistribute / full_tensor hold an empty local piece and join no
  collective (as PyTorch DTensor), while the member ranks get exact values and gradients.
"""
import pytest

from tests.harness import run_dist


def _raises_everywhere(fn, *needles):
    """``fn()`` raises a ValueError whose message contains every needle; returns the message."""
    import pytest
    with pytest.raises(ValueError) as info:
        fn()
    message = str(info.value)
    for needle in needles:
        assert needle in message, (needle, message)
    return message


def _mismatch_case(rank, world_size):
    import torch
    from hyper_parallel import DTensor, distribute_tensor, init_device_mesh
    from hyper_parallel.core.comm_mode import CommDebugMode
    from hyper_parallel.core.dtensor import Replicate, Shard

    mesh = init_device_mesh("cpu", (world_size,))
    mesh2 = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("dp", "tp"))
    full = torch.arange(48.0).reshape(8, 6)
    odd = world_size - 1  # the rank that disagrees

    # ---- from_local(run_check=True): ndim, dtype, shape
    piece = full.chunk(world_size)[rank]
    bad_ndim = piece.unsqueeze(-1) if rank == odd else piece
    _raises_everywhere(lambda: DTensor.from_local(bad_ndim, mesh, [Shard(0)], run_check=True),
                       "ndim 2 vs 3", "run_check")
    bad_dtype = piece.double() if rank == odd else piece
    _raises_everywhere(lambda: DTensor.from_local(bad_dtype, mesh, [Shard(0)], run_check=True),
                       "dtype float32 vs float64")
    bad_rows = full[:1] if rank == odd else piece  # local pieces of 2 rows, one of 1
    _raises_everywhere(lambda: DTensor.from_local(bad_rows, mesh, [Shard(0)], run_check=True), "shape=")
    # uneven pieces with the right global shape pass, and the values are the global tensor's
    uneven = torch.arange(30.0).reshape(10, 3)
    dt = DTensor.from_local(uneven.chunk(world_size)[rank] if rank < len(uneven.chunk(world_size))
                            else uneven[:0], mesh, [Shard(0)], run_check=True, shape=(10, 3))
    torch.testing.assert_close(dt.full_tensor(), uneven)
    # more dims than the fixed message spells out: the rest is still compared
    big = torch.zeros((1,) * 9 + ((3 if rank == odd else 2),))
    _raises_everywhere(lambda: DTensor.from_local(big, mesh, [Replicate()], run_check=True), "beyond dim 7")

    # ---- distribute_tensor: every rank must pass the same ndim / dtype / shape
    for src in (0, None):
        _raises_everywhere(lambda: distribute_tensor(full.unsqueeze(0) if rank == odd else full, mesh,
                                                     [Shard(0)], src_data_rank=src), "ndim 2 vs 3",
                           "distribute_tensor")
        _raises_everywhere(lambda: distribute_tensor(full.half() if rank == odd else full, mesh, [Shard(1)],
                                                     src_data_rank=src), "dtype float32 vs float16")
        _raises_everywhere(lambda: distribute_tensor(full[:7] if rank == odd else full, mesh2,
                                                     [Shard(0), Replicate()], src_data_rank=src), "dim 0: 7 vs 8")
    # the source rank's own mismatch is caught as well
    message = _raises_everywhere(lambda: distribute_tensor(full.int() if rank == 0 else full, mesh, [Shard(0)]),
                                 "float32", "int32")
    assert f"rank {rank} has" in message

    # ---- afterwards the ranks are in step: the real thing works and is exact
    mine = full + 100 * rank
    for src in (0, 2 % world_size):
        dt = distribute_tensor(mine, mesh2, [Shard(0), Shard(1)], src_data_rank=src)
        torch.testing.assert_close(dt.full_tensor(), full + 100 * src)
    with CommDebugMode() as comm:
        dt = distribute_tensor(full.requires_grad_(), mesh, [Shard(1)], src_data_rank=None)
    # no data travels with src_data_rank=None: only the small metadata check
    assert set(comm.get_comm_counts()) == {"shape_check"}, comm.get_comm_counts()
    (dt.full_tensor() * full.detach()).sum().backward()
    torch.testing.assert_close(dt.grad.full_tensor(), full.detach())
    return True


def test_mismatched_ranks_raise_on_every_rank():
    assert run_dist(4, _mismatch_case) == [True] * 4


def _outside_case(rank, world_size):
    import torch
    from hyper_parallel import DTensor, DeviceMesh, distribute_tensor
    from hyper_parallel.core.comm_mode import CommDebugMode
    from hyper_parallel.core.dtensor import Partial, Replicate, Shard
    from hyper_parallel.platform import get_platform

    members = (0, 1)
    inside = rank in members
    mesh = DeviceMesh("cpu", list(members))                   # every rank builds it, ranks 2, 3 are outside
    mesh2 = DeviceMesh("cpu", [list(members)], mesh_dim_names=("dp", "tp"))
    assert (mesh.get_coordinate() is not None) == inside
    assert (mesh2.get_coordinate() == (0, rank)) if inside else mesh2.get_coordinate() is None
    if inside:
        tp = mesh2["tp"]
        assert tp.rank_list == members and mesh2["dp"].rank_list == (rank,)
    else:   # a rank outside the mesh has no sub-mesh of its own to get (tests/test_mesh_edges.py)
        with pytest.raises(ValueError, match="not part of mesh"):
            mesh2["tp"]
        tp = mesh                                             # the same ranks, (0, 1)

    full = torch.arange(24.0).reshape(6, 4).requires_grad_()
    grad_out = torch.arange(24.0).reshape(6, 4).flip(0)
    with CommDebugMode() as comm:
        a = distribute_tensor(full, mesh, [Shard(0)])
        b = DTensor.from_local(full.detach()[rank * 3:(rank + 1) * 3] if inside else full.detach()[:3], tp,
                               [Shard(0)], run_check=True)
        c = a.redistribute(placements=[Shard(1)])
        p = DTensor.from_local(full.detach() / 2, mesh, [Partial()]).redistribute(placements=[Replicate()])
        gathered = c.full_tensor()
    assert a.shape == b.shape == c.shape == p.shape == (6, 4)
    if not inside:
        assert comm.get_total_counts() == 0, comm.get_comm_counts()
        for d in (a, b, c, p):
            assert d.to_local().numel() == 0
        assert gathered.numel() == 0
        with pytest.raises(ValueError, match="not part of mesh"):
            mesh.get_group(0)
    else:
        torch.testing.assert_close(gathered, full.detach())
        torch.testing.assert_close(b.full_tensor(), full.detach())
        torch.testing.assert_close(p.to_local(), full.detach())
        torch.testing.assert_close(c.to_local(), full.detach()[:, rank * 2:(rank + 1) * 2])
        (gathered * grad_out).sum().backward()
        torch.testing.assert_close(a.grad.full_tensor(), grad_out)
    # every rank is still in step on the world
    total = get_platform().all_reduce(torch.ones(1), get_platform().new_group(range(world_size)))
    assert total.item() == world_size
    return inside


def test_mesh_without_this_rank():
    assert run_dist(4, _outside_case) == [True, True, False, False]
