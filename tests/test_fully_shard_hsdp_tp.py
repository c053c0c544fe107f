"""HSDP × TP: fully_shard on a ("dp_replicate", "dp_shard") mesh of tensor-parallel blocks (Colwise /
Rowwise on "tp" of one 2×2×2 root mesh, 8 ranks): each parameter is a DTensor on the concatenated
(dp_replicate, dp_shard, tp) mesh; losses, every gradient and every weight after AdamW steps equal
one process on every data rank's batch (fp32, 1e-5; tests/test_fully_shard.py::_train)."""
from tests.harness import run_dist
from tests.test_fully_shard import _train


def _hsdp_tp_case(rank, world_size):
    from hyper_parallel import ColwiseParallel, RowwiseParallel, init_device_mesh, parallelize_module
    from tests import fully_shard_models as fm
    root = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp_replicate", "dp_shard", "tp"))

    def hsdp_tp(model):
        for block in model.blocks:
            parallelize_module(block, root["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        return fm.shard_net(model, root["dp_replicate", "dp_shard"])
    data_index = root.get_local_rank(0) * 2 + root.get_local_rank(1)   # the tp ranks share a batch
    model = _train(hsdp_tp, data_index, 4, what="hsdp x tp")
    up = model.blocks[0].up.weight
    assert up.device_mesh.mesh_dim_names == ("dp_replicate", "dp_shard", "tp"), up.device_mesh
    return True


def test_hsdp_times_tp_on_8_ranks():
    assert run_dist(8, _hsdp_tp_case, timeout=400) == [True] * 8
