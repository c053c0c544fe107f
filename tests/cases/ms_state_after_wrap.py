"""MindSpore: fully_shard and data_parallel when ranks disagree about the parameters they wrap
(SPEC §19): the same ValueError on every rank, before any gather or reduction, instead of gloo's
size mismatch. Imported by MindSpore workers only."""
from tests.cases.ms_fully_shard import H, _net
from tests.frameworks import expect_error


def ranks_disagree(rank, world_size):
    import mindspore as ms
    from hyper_parallel import data_parallel, fully_shard, init_device_mesh
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp_shard",))
    # rank 1's blocks are wider (rows split without an empty rank on both)
    wide = _net(hidden=H + 2 * (rank == 1))
    expect_error(ValueError, lambda: fully_shard(wide.blocks[0], mesh), "fully_shard: the ranks of",
                 "disagree on parameters of the unit (rank", "w1.weight")
    # data_parallel's reducer: a gradient tuple of another shape on rank 1
    net = _net()
    data_parallel(net, mesh)
    grads = [ms.ops.zeros((3 + (rank == 1), 2), ms.float32), ms.ops.zeros((2,), ms.float32)]
    expect_error(ValueError, lambda: net.grad_reducer_fn(grads), "data_parallel: the ranks of",
                 "disagree on gradient shapes (rank")
    return True
