"""MindSpore: fully_shard on Cells trained with nn.TrainOneStepCell equals one process.

Two blocks (uneven rows: 5 hidden units on 2 ranks are 3 + 2) and a root head, each block under
fully_shard and then the root; Adam on ``trainable_params()`` (this rank's rows); each data rank a
slice of the batch. Losses of every step, parameters and Adam's moments after the last step are
compared with one process on the whole batch (fp32, 1e-5). Imported by MindSpore workers only.
"""
import numpy as np

from tests.frameworks import close, expect_error, inp

E, H, BATCH = 4, 5, 8


def _net(out=3, hidden=H):
    import mindspore as ms
    from mindspore import mint, ops

    class Block(ms.nn.Cell):
        def __init__(self):
            super().__init__()
            self.w1, self.w2 = mint.nn.Linear(E, hidden), mint.nn.Linear(hidden, E)

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
        close(v, np.array_split(ref_moments[p.name][1], n, 0)[me], f"{p.name} Adam v", rtol=tol,
              atol=tol / 10)
    close(net.blocks[0].w1.weight.full_tensor(), ref_params[ref.blocks[0].w1.weight.name], "full_tensor()",
          rtol=tol, atol=tol)
    net.unshard()   # the whole weights installed until reshard()
    assert not isinstance(net.head.weight, DTensor)
    close(net.head.weight, ref_params[ref.head.weight.name], "unshard()", rtol=tol, atol=tol)
    net.reshard()
    assert isinstance(net.head.weight, DTensor) and net.head.weight.placements[-1].is_shard(0)
    return True


def unsupported_parts(rank, world_size):
    """What MindSpore's fully_shard refuses, by name: unreduced accumulation, and a parameter whose
    rows leave a rank an empty shard (MindSpore's optimizers refuse 0-size state)."""
    from hyper_parallel import DTensor, fully_shard, init_device_mesh
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp_shard",))
    net = fully_shard(_net(), mesh)
    expect_error(NotImplementedError, lambda: net.set_requires_gradient_sync(False),
                 "set_requires_gradient_sync(False)", "accumulate the reduced")
    net.set_requires_gradient_sync(True)
    net.set_reshard_after_forward(False)
    expect_error(ValueError, lambda: net.set_reshard_after_backward("no"), "True or False")
    small = _net(out=1)
    expect_error(ValueError, lambda: fully_shard(small, mesh), "Linear.weight has 1 rows",
                 f"over {world_size} ranks leave a rank without rows")
    # refused before any parameter changed: the blocks (registered before the head) are untouched
    assert not any(isinstance(v, DTensor) for v in vars(small.blocks[0].w1).values())
    return True


# how TP splits the blocks' parameters (Colwise w1, Rowwise w2); None: whole on every TP rank
TP_DIMS = {"w1.weight": 0, "w1.bias": 0, "w2.weight": 1, "w2.bias": None}


def tp_matches_one_process(rank, world_size, steps=3, lr=0.05):
    """TP × ZeRO-3 on a (dp_shard, tp) 2×2 mesh: Colwise/Rowwise blocks, then fully_shard over
    dp_shard (each TP shard split again on dim 0, 3 rows as 2 + 1); losses, each rank's rows of the
    weights and of Adam's moments equal one process."""
    import mindspore as ms
    from hyper_parallel import ColwiseParallel, RowwiseParallel, fully_shard, init_device_mesh
    from hyper_parallel import parallelize_module
    from hyper_parallel.platform import get_platform
    mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("dp_shard", "tp"))
    dp, tp = mesh.get_coordinate()
    xs, ys = inp("fsdpx", 0, (BATCH, E)), inp("fsdpy", 0, (BATCH, 3))
    ref = _net(hidden=6)
    ref_step, ref_opt = _step(ref, xs, ys, lr)
    ref_losses = [float(ref_step(ms.Tensor(xs)).asnumpy()) for _ in range(steps)]
    ref_params, ref_moments = {p.name: p.asnumpy() for p in ref.trainable_params()}, _moments(ref, ref_opt)
    net = _net(hidden=6)
    for block in net.blocks:
        parallelize_module(block, mesh["tp"], {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
        fully_shard(block, mesh["dp_shard"])
    fully_shard(net, mesh["dp_shard"])
    assert net.blocks[0].w1.weight.device_mesh.mesh_dim_names == ("dp_shard", "tp")
    rows = slice(dp * BATCH // 2, (dp + 1) * BATCH // 2)
    step, opt = _step(net, xs[rows], ys[rows], lr)
    losses = [float(step(ms.Tensor(xs[rows])).asnumpy()) for _ in range(steps)]
    losses = get_platform().all_reduce(ms.Tensor(np.asarray(losses, np.float32)),
                                       mesh["dp_shard"].get_group(), op="avg").asnumpy()
    close(losses, np.asarray(ref_losses, np.float32), "losses", rtol=1e-5, atol=1e-5)

    def mine(name, full):
        dim = TP_DIMS.get(".".join(name.split(".")[-2:])) if name.startswith("blocks") else None
        piece = full if dim is None else np.array_split(full, 2, dim)[tp]
        return np.array_split(piece, 2, 0)[dp]
    for p, (m, v) in zip(net.trainable_params(), _moments(net, opt).values()):
        close(p.asnumpy(), mine(p.name, ref_params[p.name]), f"{p.name} rows", rtol=1e-5, atol=1e-5)
        close(m, mine(p.name, ref_moments[p.name][0]), f"{p.name} Adam m", rtol=1e-5, atol=1e-5)
        close(v, mine(p.name, ref_moments[p.name][1]), f"{p.name} Adam v", rtol=1e-5, atol=1e-6)
    return True
