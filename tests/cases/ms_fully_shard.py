"""MindSpore: fully_shard on Cells trained with nn.TrainOneStepCell equals one process.

Two blocks (uneven rows: 5 hidden units on 2 ranks are 3 + 2) and a root head, each block under
fully_shard and then the root; Adam on ``trainable_params()`` (this rank's rows); each data rank a
slice of the batch. Losses of every step, parameters and Adam's moments after the last step are
compared with one process on the whole batch (fp32, 1e-5). Imported by MindSpore workers only.
"""
import numpy as np

from tests.frameworks import close, expect_error, inp

E, H, BATCH = 4, 5, 8


def _net(out=3):
    import mindspore as ms
    from mindspore import mint, ops

    class Block(ms.nn.Cell):
        def __init__(self):
            super().__init__()
            self.w1, self.w2 = mint.nn.Linear(E, H), mint.nn.Linear(H, E)

        def construct(self, x):
            return x + self.w2(ops.tanh(self.w1(x)))

    class Net(ms.nn.Cell):
        def __init__(self):
            super().__init__()
            self.blocks = ms.nn.CellList([Block(), Block()])
            self.head = mint.nn.Linear(E, out)

        def construct(self, x):
            for block in self.blocks:
                x = block(x)
            return self.head(x)
    net = Net()
    for name, param in net.parameters_and_names():
        param.set_data(ms.Tensor(inp(f"fsdp{name}", 0, param.shape) * 0.5))
    return net


def _step(net, x, y, lr):
    import mindspore as ms

    class WithLoss(ms.nn.Cell):
        def __init__(self):
            super().__init__(auto_prefix=False)
            self.net = net

        def construct(self, x):
            return ((self.net(x) - ms.Tensor(y)) ** 2).mean()
    opt = ms.nn.Adam(net.trainable_params(), learning_rate=lr)
    return ms.nn.TrainOneStepCell(WithLoss(), opt), opt


def _moments(net, opt):
    """{parameter name: (first moment, second moment)} of Adam."""
    return {p.name: (m.asnumpy(), v.asnumpy())
            for p, m, v in zip(net.trainable_params(), opt.moment1, opt.moment2)}


def train_matches_one_process(rank, world_size, shape=None, steps=3, lr=0.05, out=3, mp=None, tol=1e-5):
    """``shape``: the mesh (default (world_size,), ZeRO-3; (2, 1) HSDP: 2 replicas of 1 shard);
    ``out``: the head's rows; ``mp``: a MixedPrecisionPolicy's
    keyword arguments, dtype names (compared at ``tol``)."""
    import mindspore as ms
    from hyper_parallel import DTensor, fully_shard, init_device_mesh
    shape = tuple(shape or (world_size,))
    names = ("dp_shard",) if len(shape) == 1 else ("dp_replicate", "dp_shard")
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    xs, ys = inp("fsdpx", 0, (BATCH, E)), inp("fsdpy", 0, (BATCH, out))
    ref = _net(out)
    ref_step, ref_opt = _step(ref, xs, ys, lr)
    ref_losses = [float(ref_step(ms.Tensor(xs)).asnumpy()) for _ in range(steps)]
    ref_params = {p.name: p.asnumpy() for p in ref.trainable_params()}
    ref_moments = _moments(ref, ref_opt)

    net = _net(out)
    from hyper_parallel import MixedPrecisionPolicy
    policy = MixedPrecisionPolicy(**{k: getattr(ms, v) for k, v in (mp or {}).items()})
    for block in net.blocks:
        fully_shard(block, mesh, mp_policy=policy)
    fully_shard(net, mesh, mp_policy=policy)
    shard = mesh["dp_shard"] if len(shape) == 2 else mesh
    n, me = shard.size(), shard.get_local_rank()
    views = [(path, n_) for path, c in net.cells_and_names() for n_, v in c.__dict__.items()
             if isinstance(v, DTensor)]
    assert len(views) == 10, views   # every parameter reads as a sharded DTensor between steps
    rows = slice(rank * BATCH // world_size, (rank + 1) * BATCH // world_size)
    step, opt = _step(net, xs[rows], ys[rows], lr)
    losses = [float(step(ms.Tensor(xs[rows])).asnumpy()) for _ in range(steps)]
    from hyper_parallel.platform import get_platform
    losses = get_platform().all_reduce(ms.Tensor(np.asarray(losses, np.float32)), mesh.get_group()
                                       if len(shape) == 1 else None, op="avg").asnumpy()
    close(losses, np.asarray(ref_losses, np.float32), "losses", rtol=tol, atol=tol)
    for p, (m, v) in zip(net.trainable_params(), _moments(net, opt).values()):
        full = ref_params[p.name]
        mine = np.array_split(full, n, 0)[me]
        close(p.asnumpy(), mine, f"{p.name} (this rank's rows)", rtol=tol, atol=tol)
        close(m, np.array_split(ref_moments[p.name][0], n, 0)[me], f"{p.name} Adam m", rtol=tol, atol=tol)
        close(v, np.array_split(ref_moments[p.name][1], n, 0)[me], f"{p.name} Adam v", rtol=tol, atol=tol / 10)
    close(net.blocks[0].w1.weight.full_tensor(), ref_params[ref.blocks[0].w1.weight.name], "full_tensor()",
          rtol=tol, atol=tol)
    net.unshard()   # the whole weights installed until reshard()
    assert not isinstance(net.head.weight, DTensor)
    close(net.head.weight, ref_params[ref.head.weight.name], "unshard()", rtol=tol, atol=tol)
    net.reshard()
    assert isinstance(net.head.weight, DTensor) and net.head.weight.placements[-1].is_shard(0)
    return True


def unsupported_parts(rank, world_size):
    """What MindSpore's fully_shard refuses, by name: unreduced accumulation, TP parameters, and a
    parameter whose rows leave a rank an empty shard (MindSpore's optimizers refuse 0-size state)."""
    from hyper_parallel import ColwiseParallel, fully_shard, init_device_mesh, parallelize_module
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp_shard",))
    net = fully_shard(_net(), mesh)
    expect_error(NotImplementedError, lambda: net.set_requires_gradient_sync(False),
                 "set_requires_gradient_sync(False)", "accumulate the reduced")
    net.set_requires_gradient_sync(True)
    net.set_reshard_after_forward(False)
    expect_error(ValueError, lambda: net.set_reshard_after_backward("no"), "True or False")
    tp = _net()
    parallelize_module(tp.head, init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",)),
                       ColwiseParallel())
    expect_error(NotImplementedError, lambda: fully_shard(tp, mesh), "Linear.weight", "tensor-parallel",
                 "torch only")
    from hyper_parallel import DTensor
    # refused before any parameter changed: the blocks (registered before the head) are untouched
    assert not any(isinstance(v, DTensor) for v in vars(tp.blocks[0].w1).values())
    expect_error(ValueError, lambda: fully_shard(_net(out=1), mesh), "Linear.weight has 1 rows",
                 f"over {world_size} ranks leave a rank without rows")
    return True
