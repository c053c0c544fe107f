"""Checkpoints of DTensor state: ``torch.save`` / ``torch.load`` of DTensors (a rank's own piece,
reloaded on the same mesh) and ``torch.distributed.checkpoint`` saved on 4 ranks (TP=4, and a
cp2 x tp2 mesh) and loaded on 2 ranks in other placements and into one process as plain tensors,
each compared with the single-process values (exact: checkpoints copy bytes).
"""
from tests.harness import run_dist

DIM, HIDDEN = 8, 12


def _model():
    import torch
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(DIM, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, DIM))


def _grid():
    import torch
    return torch.arange(8 * 12, dtype=torch.float32).reshape(8, 12)


def _tp(model, mesh):
    from hyper_parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    return parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})


def _save_case(rank, world_size, path):
    import torch
    import torch.distributed.checkpoint as dcp
    from hyper_parallel import Replicate, Shard, distribute_tensor, init_device_mesh
    tp = init_device_mesh("cpu", (4,))
    model = _tp(_model(), tp)
    dcp.save(model.state_dict(), checkpoint_id=f"{path}/tp4")
    mesh2d = init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp", "tp"))
    state = {"grid": distribute_tensor(_grid(), mesh2d, [Shard(0), Shard(1)]),
             "rows": distribute_tensor(_grid(), mesh2d, [Replicate(), Shard(0)]), "step": 7}
    dcp.save(state, checkpoint_id=f"{path}/cp2tp2")
    # torch.save / torch.load of DTensors: this rank's piece, back on the same (sub-)mesh
    pieces = {"w": model[0].weight.detach(), "grid": state["grid"], "rows_tp": state["rows"]}
    torch.save(pieces, f"{path}/rank{rank}.pt")
    with mesh2d:
        loaded = torch.load(f"{path}/rank{rank}.pt", weights_only=True)
    for key, want in pieces.items():
        got = loaded[key]
        assert got.placements == want.placements and got.device_mesh == want.device_mesh, key
        torch.testing.assert_close(got.full_tensor(), want.full_tensor(), rtol=0, atol=0)
    return True


def _load_case(rank, world_size, path):
    import torch
    import torch.distributed.checkpoint as dcp
    from hyper_parallel import Replicate, Shard, distribute_tensor, init_device_mesh
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(5)
    model = _tp(torch.nn.Sequential(torch.nn.Linear(DIM, HIDDEN), torch.nn.ReLU(),
                                    torch.nn.Linear(HIDDEN, DIM)), mesh)
    dcp.load(model.state_dict(), checkpoint_id=f"{path}/tp4")   # into the live parameters, in place
    for (name, want), got in zip(_model().state_dict().items(), model.state_dict().values()):
        torch.testing.assert_close(got.full_tensor(), want, rtol=0, atol=0, msg=name)
    state = {"grid": distribute_tensor(torch.zeros(8, 12), mesh, [Shard(1)]),
             "rows": distribute_tensor(torch.zeros(8, 12), mesh, [Replicate()]), "step": 0}
    dcp.load(state, checkpoint_id=f"{path}/cp2tp2")
    for key in ("grid", "rows"):
        torch.testing.assert_close(state[key].full_tensor(), _grid(), rtol=0, atol=0, msg=key)
    assert state["step"] == 7
    # a pickled DTensor whose mesh this process lacks: an error that names the fix
    import pytest
    from hyper_parallel.core.dtensor.mesh_registry import find_mesh
    with pytest.raises(ValueError, match="with mesh:"):
        find_mesh(("cpu", (1,), (rank,), ("tp",)))
    return True


def test_dcp_reshards_and_torch_save_roundtrips(tmp_path):
    import torch
    import torch.distributed.checkpoint as dcp
    path = str(tmp_path)
    assert run_dist(4, _save_case, path) == [True] * 4
    assert run_dist(2, _load_case, path) == [True] * 2
    # one process, plain tensors
    plain = {k: torch.zeros_like(v) for k, v in _model().state_dict().items()}
    dcp.load(plain, checkpoint_id=f"{path}/tp4", no_dist=True)
    for key, want in _model().state_dict().items():
        torch.testing.assert_close(plain[key], want, rtol=0, atol=0, msg=key)
    grid = {"grid": torch.zeros(8, 12), "rows": torch.zeros(8, 12)}
    dcp.load(grid, checkpoint_id=f"{path}/cp2tp2", no_dist=True)
    torch.testing.assert_close(grid["grid"], _grid(), rtol=0, atol=0)
    torch.testing.assert_close(grid["rows"], _grid(), rtol=0, atol=0)
