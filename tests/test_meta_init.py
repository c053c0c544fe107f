"""Meta-device initialisation, as PyTorch DTensor users do it (issue 23, item 7): DTensors and
``parallelize_module`` on the meta device, then ``module.to_empty(device=...)`` allocates each
rank's own piece. The cross-rank check must not read meta data (it failed with "Cannot copy out of
meta tensor") and no data collective may run on meta pieces. torch only: MindSpore has no meta device.
"""
from tests.harness import run_dist


def _meta_dtensor_case(rank, world_size):
    import torch
    from hyper_parallel import DTensor, distribute_tensor, init_device_mesh
    from hyper_parallel.core.comm_mode import CommDebugMode
    from hyper_parallel.core.dtensor import Replicate, Shard

    mesh = init_device_mesh("cpu", (world_size,))
    meta = torch.empty(2 * world_size + 1, 6, device="meta")
    with CommDebugMode() as comm:
        dts = [distribute_tensor(meta, mesh, [Shard(0)]),                       # from rank 0: no data to send
               distribute_tensor(meta, mesh, [Replicate()], src_data_rank=None),
               DTensor.from_local(torch.empty(2, 6, device="meta"), mesh, [Shard(0)], run_check=True),
               DTensor.from_local(torch.empty(3, 6, device="meta"), mesh, [Replicate()], run_check=True)]
    assert set(comm.get_comm_counts()) == {"shape_check"}, comm.get_comm_counts()  # metadata only
    rows = torch.empty(2 * world_size + 1).chunk(world_size)[rank].shape[0]
    rows_all = 2 * world_size + 1
    assert [d.shape for d in dts] == [(rows_all, 6), (rows_all, 6), (2 * world_size, 6), (3, 6)]
    assert [d.to_local().shape for d in dts] == [(rows, 6), (2 * world_size + 1, 6), (2, 6), (3, 6)]
    assert all(d.to_local().is_meta for d in dts)
    # ranks that disagree are caught on meta tensors too, on every rank
    import pytest
    odd = torch.empty(2, 6, device="meta", dtype=torch.float16 if rank == 1 else torch.float32)
    with pytest.raises(ValueError, match="dtype float32 vs float16"):
        DTensor.from_local(odd, mesh, [Shard(0)], run_check=True)
    with pytest.raises(ValueError, match="dim 0: 7 vs 8"):
        distribute_tensor(torch.empty(7 if rank == 0 else 8, 2, device="meta"), mesh, [Shard(0)])
    return True


def test_meta_dtensors():
    assert run_dist(2, _meta_dtensor_case) == [True, True]


def _meta_parallelize_case(rank, world_size):
    import torch
    import torch.nn as nn
    from hyper_parallel import (ColwiseParallel, DTensor, RowwiseParallel, SequenceParallel, init_device_mesh,
                                parallelize_module)
    from hyper_parallel.core.dtensor import Replicate, Shard

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))

    def build():
        # 7 hidden features: uneven over 2 and 4 ranks (torch.chunk pieces)
        return nn.Sequential(nn.LayerNorm(6), nn.Linear(6, 7), nn.ReLU(), nn.Linear(7, 6))
    torch.manual_seed(3)
    ref = build()
    with torch.device("meta"):
        model = build()
    plan = {"0": SequenceParallel(), "1": ColwiseParallel(input_layouts=Shard(1)), "3": RowwiseParallel()}
    parallelize_module(model, mesh, plan)
    assert all(isinstance(p, DTensor) and p.to_local().is_meta for p in model.parameters())
    model.to_empty(device="cpu")
    params = dict(model.named_parameters())
    for name, ref_param in ref.named_parameters():
        p = params[name]
        assert isinstance(p, DTensor) and isinstance(p, nn.Parameter) and p.requires_grad, name
        assert p.shape == ref_param.shape and p.to_local().device.type == "cpu", name
        placement = p.placements[0]
        want = (ref_param.detach().chunk(world_size, placement.dim)[rank] if placement.is_shard()
                else ref_param.detach())
        assert p.to_local().shape == want.shape, (name, p.to_local().shape, want.shape)
        with torch.no_grad():  # initialise each rank's own piece, as an init function would
            p.to_local().copy_(want)
    assert tuple(params["1.weight"].placements) == (Shard(0),)
    assert tuple(params["0.weight"].placements) == (Replicate(),)
    x = torch.randn(2, 2 * world_size, 6)
    out = model(x[:, 2 * rank:2 * rank + 2])
    torch.testing.assert_close(out, ref(x))
    out.sum().backward()
    ref(x).sum().backward()
    torch.testing.assert_close(params["3.weight"].grad.full_tensor(), ref[3].weight.grad)
    return True


def test_parallelize_module_on_meta_then_to_empty():
    for world_size in (2, 4):
        assert run_dist(world_size, _meta_parallelize_case) == [True] * world_size
