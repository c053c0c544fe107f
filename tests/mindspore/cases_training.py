"""MindSpore training pieces against one process: DTensor factories, data_parallel's gradient reducer
in nn.TrainOneStepCell (DP, DP x TP), checkpoints with layouts (save sharded, load whole / on another
layout / from a full single-process file), the GRAPH_MODE errors.

Imported by MindSpore workers only (no torch, no pytest); results are plain Python values.
"""
import numpy as np

from tests.frameworks import close, expect_error, inp

E, F, BATCH = 4, 8, 8
# how TP splits each MLP parameter: Colwise w1 (rows, bias), Rowwise w2 (columns); None = whole
SPLITS = {"w1.weight": 0, "w1.bias": 0, "w2.weight": 1, "w2.bias": None}


def _mlp(arrays=None):
    import mindspore as ms
    from mindspore import mint, ops

    class MLP(ms.nn.Cell):
        def __init__(self):
            super().__init__()
            self.w1, self.w2 = mint.nn.Linear(E, F), mint.nn.Linear(F, E)

        def construct(self, x):
            return self.w2(ops.relu(self.w1(x)))
    net = MLP()
    arrays = arrays or {n: inp(f"train{n}", 0, p.shape) for n, p in net.parameters_and_names()}
    for name, param in net.parameters_and_names():
        param.set_data(ms.Tensor(arrays[name]))
    return net, arrays


class _Loss:
    def __new__(cls, net, target):
        import mindspore as ms

        class WithLoss(ms.nn.Cell):
            def __init__(self):
                super().__init__(auto_prefix=False)
                self.net = net

            def construct(self, x):
                y = self.net(x)
                return ((y - ms.Tensor(target)) ** 2).mean()
        return WithLoss()


def _tp(net, mesh):
    from hyper_parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    return parallelize_module(net, mesh, {"w1": ColwiseParallel(), "w2": RowwiseParallel()})


def _piece(array, name, tp_rank, tp_size):
    dim = SPLITS[name]
    return array if dim is None or tp_size == 1 else np.split(array, tp_size, dim)[tp_rank]


# ============================================================================ factories
def factories(rank, world_size):
    import mindspore as ms
    from mindspore import ops
    import hyper_parallel as hp
    from hyper_parallel import Partial, Replicate, Shard, init_device_mesh
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    for placements in ([Shard(0)], [Shard(1)], [Replicate()], [Partial()]):
        for name, want in (("zeros", np.zeros((6, 4))), ("ones", np.ones((6, 4))),
                           ("full", np.full((6, 4), 2.5))):
            args = ((6, 4), 2.5) if name == "full" else (6, 4)
            dt = getattr(hp, name)(*args, device_mesh=mesh, placements=placements)
            assert tuple(dt.shape) == (6, 4) and dt.placements == tuple(placements), (name, dt.placements)
            close(dt.full_tensor(), want.astype(np.float32), f"{name} {placements}", rtol=0, atol=0)
        for name in ("rand", "randn"):
            ms.set_seed(11)
            dt = getattr(hp, name)(6, 4, device_mesh=mesh, placements=placements)
            ms.set_seed(11)
            close(dt.full_tensor(), getattr(ops, name)(6, 4), f"{name} {placements}", rtol=0, atol=0)
    assert hp.empty((4, 2), device_mesh=mesh, dtype=ms.float64).to_local().dtype == ms.float64
    assert hp.zeros(3, device_mesh=mesh).dtype == ms.float32
    assert hp.randn(4, device_mesh=mesh, placements=[Shard(0)], requires_grad=True).requires_grad
    with mesh:
        dt = hp.ones(4, 2, placements=[Shard(0)])
    assert tuple(dt.to_local().shape) == (4 // world_size, 2)
    expect_error(ValueError, lambda: hp.zeros(-1, device_mesh=mesh), "non-negative")
    return True


# ============================================================================ data parallel
def _reference_steps(arrays, xs, ys, steps, lr):
    """Single process: losses per step, gradients of step 1, parameters after ``steps``."""
    import mindspore as ms
    net, _ = _mlp(arrays)
    loss_cell = _Loss(net, ys)
    params = net.trainable_params()
    grads = ms.grad(loss_cell, None, params)(ms.Tensor(xs))
    step = ms.nn.TrainOneStepCell(loss_cell, ms.nn.Adam(params, learning_rate=lr))
    losses = [float(step(ms.Tensor(xs)).asnumpy()) for _ in range(steps)]
    return losses, {p.name: g.asnumpy() for p, g in zip(params, grads)}, \
        {p.name: p.asnumpy() for p in params}


def _dp_losses(losses, mesh):
    """The global mean loss of each step from the data-parallel ranks' local ones."""
    from hyper_parallel.platform import get_platform
    import mindspore as ms
    platform = get_platform()
    out = platform.all_reduce(ms.Tensor(np.asarray(losses, np.float32)), mesh.get_group(), op="avg")
    return [float(v) for v in out.asnumpy()]


def data_parallel_train(rank, world_size, tp_size, steps=3, lr=0.05, flatten=False):
    """``world_size // tp_size`` data-parallel ranks (each a slice of the batch) x ``tp_size`` TP
    ranks: losses per step, the reduced gradients of step 1 and the parameters after ``steps``
    Adam steps equal one process on the whole batch. ``flatten``: no TP, a (dp, cp) mesh whose
    flattened dp x cp mesh is the data-parallel one (every rank a different slice)."""
    import mindspore as ms
    from hyper_parallel import data_parallel, init_device_mesh
    dp_size = world_size // tp_size
    mesh = init_device_mesh("cpu", (dp_size, tp_size), mesh_dim_names=("dp", "tp"))
    dp_rank, tp_rank = mesh.get_coordinate()
    if flatten:
        grid = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("dp", "cp"))
        dp_mesh = grid["dp", "cp"].flatten()
        assert dp_mesh.ndim == 1 and dp_mesh.size() == world_size
        dp_rank = dp_mesh.get_coordinate()[0]
    else:
        dp_mesh = mesh["dp"]
    xs, ys = inp("trainx", 0, (BATCH, E)), inp("trainy", 0, (BATCH, E))
    ref_losses, ref_grads, ref_params = _reference_steps(None, xs, ys, steps, lr)
    net, _ = _mlp()
    if tp_size > 1:
        _tp(net, mesh["tp"])
    rows = slice(dp_rank * BATCH // dp_size, (dp_rank + 1) * BATCH // dp_size)
    x, y = ms.Tensor(xs[rows]), ys[rows]
    loss_cell = _Loss(net, y)
    params = net.trainable_params()
    step = ms.nn.TrainOneStepCell(loss_cell, ms.nn.Adam(params, learning_rate=lr))
    assert data_parallel(step, dp_mesh) is step
    grads = step.grad_reducer(ms.grad(loss_cell, None, params)(x))
    for p, g in zip(params, grads):
        close(g, _piece(ref_grads[p.name], p.name, tp_rank, tp_size), f"reduced gradient of {p.name}")
    losses = [float(step(x).asnumpy()) for _ in range(steps)]
    close(_dp_losses(losses, dp_mesh), ref_losses, "per-step global loss")
    for p in params:
        close(p, _piece(ref_params[p.name], p.name, tp_rank, tp_size), f"{p.name} after {steps} steps")
    return losses


def data_parallel_details(rank, world_size):
    """no_sync (local gradients), sum instead of mean, a Cell that is not a train step, the errors."""
    import mindspore as ms
    from hyper_parallel import data_parallel, init_device_mesh
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    x = ms.Tensor(inp("detx", rank, (2, E)))
    net, _ = _mlp()
    loss_cell = _Loss(net, inp("dety", rank, (2, E)))
    params = net.trainable_params()
    # a plain Cell: the reducer is grad_reducer_fn; ~200-byte buckets: two of two tensors
    data_parallel(loss_cell, mesh, average=False, bucket_mb=2e-4)
    assert [len(b) for b in loss_cell.grad_reducer_fn._buckets(
        [p for p in net.trainable_params()])] == [2, 2], "bucketing"
    local = ms.grad(loss_cell, None, params)(x)         # the Cell stays differentiable as before
    with loss_cell.no_sync():
        same = loss_cell.grad_reducer_fn(local)
    summed = loss_cell.grad_reducer_fn(local)
    for g, loc in zip(same, local):
        close(g, loc.asnumpy(), "no_sync leaves the local gradient")
    total = None
    for r in range(world_size):             # every rank's gradient, computed here, summed
        net_r, _ = _mlp()
        cell = _Loss(net_r, inp("dety", r, (2, E)))
        g_r = ms.grad(cell, None, net_r.trainable_params())(ms.Tensor(inp("detx", r, (2, E))))
        total = [a.asnumpy() for a in g_r] if total is None else [t + a.asnumpy() for t, a in zip(total, g_r)]
    for s, want in zip(summed, total):
        close(s, want, "average=False sums")
    expect_error(ValueError, lambda: data_parallel(loss_cell, mesh), "already applied")
    mesh2 = init_device_mesh("cpu", (1, world_size), mesh_dim_names=("a", "b"))
    expect_error(ValueError, lambda: data_parallel(_mlp()[0], mesh2), "1-D mesh")
    tp_net = _tp(_mlp()[0], mesh)
    expect_error(ValueError, lambda: data_parallel(tp_net, mesh), "shares ranks", "w1.weight")
    return True


def graph_mode_errors(rank, world_size, directory):
    """GRAPH_MODE: the data-parallel train step, data_parallel and the checkpoints raise a
    hyper_parallel RuntimeError naming GRAPH_MODE and the fix; loss_parallel raises on MindSpore."""
    import mindspore as ms
    from hyper_parallel import data_parallel, init_device_mesh, loss_parallel
    from hyper_parallel.core.dtensor.checkpoint_layout import load_layout_checkpoint, save_layout_checkpoint
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    net, _ = _mlp()
    loss_cell = _Loss(net, inp("gy", 0, (2, E)))
    step = data_parallel(ms.nn.TrainOneStepCell(loss_cell, ms.nn.SGD(net.trainable_params())), mesh)
    x = ms.Tensor(inp("gx", rank, (2, E)))
    step(x)
    import os
    os.environ["MS_OM_PATH"] = directory    # MindSpore dumps analyze_fail.ir of failed compiles there
    ms.set_context(mode=ms.GRAPH_MODE)
    try:
        for fn in (lambda: step(x), lambda: data_parallel(_mlp()[0], mesh),
                   lambda: save_layout_checkpoint(net, directory),
                   lambda: load_layout_checkpoint(net, directory)):
            expect_error(RuntimeError, fn, "GRAPH_MODE", "PYNATIVE_MODE")
        # a parallelized Cell compiled in GRAPH_MODE or under ms.jit: MindSpore's parser fails inside
        # hyper_parallel's hooks; the platform turns that into its own error
        tp_net, xt = _tp(_mlp()[0], mesh), ms.Tensor(inp("gx", 0, (2, E)))   # TP: one input for all ranks
        expect_error(RuntimeError, lambda: tp_net(xt), "GRAPH_MODE", "PYNATIVE_MODE", "ms.jit")
    finally:
        ms.set_context(mode=ms.PYNATIVE_MODE)

    def forward(v):
        return tp_net(v)
    expect_error(RuntimeError, lambda: ms.jit(forward)(xt), "GRAPH_MODE", "PYNATIVE_MODE", "ms.jit")

    def unrelated(v):
        from os import path  # noqa: F401 -- unsupported in graphs: MindSpore's own error, unchanged
        return v
    try:
        ms.jit(unrelated)(xt)
    except RuntimeError as exc:
        assert "Unsupported statement" in str(exc) and "PYNATIVE_MODE" not in str(exc), str(exc)[:300]
    ref, _ = _mlp()
    close(tp_net(xt), ref(xt).asnumpy(), "PyNative forward after the graph-mode failures")
    expect_error(NotImplementedError, lambda: loss_parallel().__enter__(), "loss_parallel", "MindSpore")
    os.environ.pop("MS_OM_PATH", None)
    return True


# ============================================================================ checkpoints
def _saved_arrays():
    return {n: inp(f"ckpt{n}", 0, s) for n, s in
            (("w1.weight", (F, E)), ("w1.bias", (F,)), ("w2.weight", (E, F)), ("w2.bias", (E,)))}


def _check_pieces(net, arrays, splits, tp_rank, tp_size, what):
    for p in net.trainable_params():
        dim = splits[p.name]
        want = arrays[p.name] if dim is None else np.split(arrays[p.name], tp_size, dim)[tp_rank]
        close(p, want, f"{what}: {p.name}", rtol=0, atol=0)


def checkpoint_save(rank, world_size, directory):
    """TP over the world (Colwise w1, Rowwise w2): each rank writes its shards and their layouts."""
    from hyper_parallel import init_device_mesh
    from hyper_parallel.core.dtensor.checkpoint_layout import read_layouts, save_layout_checkpoint
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    net = _tp(_mlp(_saved_arrays())[0], mesh)
    save_layout_checkpoint(net, directory)
    layouts = read_layouts(directory)
    w1 = layouts[rank]["params"]["w1.weight"]
    assert w1["global_shape"] == [F, E] and w1["placements"] == [["Shard", 0]], w1
    assert w1["mesh"]["shape"] == [world_size] and w1["offsets"] == [rank * F // world_size, 0], w1
    # the replicated bias is written once, by the rank at coordinate 0
    assert ("w2.bias" in layouts[rank]["params"]) == (rank == 0)
    return True


def single_process_load(directory):
    """One process, no launcher: the whole parameters of a plain Cell from the sharded files."""
    from hyper_parallel.core.dtensor.checkpoint_layout import load_layout_checkpoint
    net, _ = _mlp()
    missing, unexpected = load_layout_checkpoint(net, directory)
    assert missing == [] and unexpected == [], (missing, unexpected)
    _check_pieces(net, _saved_arrays(), dict.fromkeys(SPLITS), 0, 1, "one process")
    return True


def checkpoint_load_layouts(rank, world_size, directory):
    """The checkpoint ``checkpoint_save`` wrote (2 ranks) loads on this world: whole into a plain
    Cell, into the TP plan over the world (another number of shards when the world is not 2), into
    a swapped plan (Rowwise w1, Colwise w2); a single-process MindSpore checkpoint loads into a
    parallelized Cell and gives its forward; missing names and shape mismatches raise."""
    import mindspore as ms
    from hyper_parallel import ColwiseParallel, RowwiseParallel, init_device_mesh, parallelize_module
    from hyper_parallel.core.dtensor.checkpoint_layout import load_layout_checkpoint
    arrays = _saved_arrays()
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    plain, _ = _mlp()
    load_layout_checkpoint(plain, directory)
    _check_pieces(plain, arrays, dict.fromkeys(SPLITS), 0, 1, "whole")
    net = _tp(_mlp()[0], mesh)
    load_layout_checkpoint(net, directory)
    _check_pieces(net, arrays, SPLITS, rank, world_size, f"TP over {world_size}")
    swapped = parallelize_module(_mlp()[0], mesh, {"w1": RowwiseParallel(), "w2": ColwiseParallel()})
    load_layout_checkpoint(swapped, directory)
    _check_pieces(swapped, arrays, {"w1.weight": 1, "w1.bias": None, "w2.weight": 0, "w2.bias": 0},
                  rank, world_size, "swapped plan")
    ref, _ = _mlp(arrays)
    full_file = f"{directory}/full{rank}.ckpt"
    ms.save_checkpoint(ref, full_file)
    net2 = _tp(_mlp()[0], mesh)
    load_layout_checkpoint(net2, full_file)
    x = ms.Tensor(inp("ckptx", 0, (3, E)))
    close(net2(x), ref(x).asnumpy(), "forward after loading a single-process checkpoint")

    class Wider(ms.nn.Cell):
        def __init__(self):
            super().__init__()
            self.w1 = ms.mint.nn.Linear(E, 2 * F)
    expect_error(ValueError, lambda: load_layout_checkpoint(Wider(), directory), "w1.weight", "global shape")

    class Extra(ms.nn.Cell):
        def __init__(self):
            super().__init__()
            self.w3 = ms.mint.nn.Linear(E, E)
    expect_error(ValueError, lambda: load_layout_checkpoint(Extra(), directory), "w3.weight", "strict=False")
    assert load_layout_checkpoint(Extra(), directory, strict=False)[0] == ["w3.bias", "w3.weight"]
    return True


def checkpoint_resume(rank, world_size, directory):
    """Train 2 Adam steps on DP2 x TP2, save the train step (parameters and Adam's state), resume
    on TP4 (4 ranks, whole batch) and in a plain Cell of this process: the next 2 steps' losses and
    the final parameters equal 4 steps in one process."""
    import mindspore as ms
    from hyper_parallel import data_parallel, init_device_mesh
    from hyper_parallel.core.dtensor.checkpoint_layout import load_layout_checkpoint, save_layout_checkpoint
    xs, ys = inp("trainx", 0, (BATCH, E)), inp("trainy", 0, (BATCH, E))
    ref_losses, _, ref_params = _reference_steps(None, xs, ys, 4, 0.05)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_rank, _ = mesh.get_coordinate()
    net = _tp(_mlp()[0], mesh["tp"])
    rows = slice(dp_rank * BATCH // 2, (dp_rank + 1) * BATCH // 2)
    adam = ms.nn.Adam(net.trainable_params(), learning_rate=0.05)
    step = ms.nn.TrainOneStepCell(_Loss(net, ys[rows]), adam)
    data_parallel(step, mesh["dp"])
    losses = [float(step(ms.Tensor(xs[rows])).asnumpy()) for _ in range(2)]
    close(_dp_losses(losses, mesh["dp"]), ref_losses[:2], "DP x TP steps 1-2")
    save_layout_checkpoint(step, directory)
    tp4 = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    for where, cell in (("TP4", _tp(_mlp()[0], tp4)), ("one process", _mlp()[0])):
        adam = ms.nn.Adam(cell.trainable_params(), learning_rate=0.05)
        step = ms.nn.TrainOneStepCell(_Loss(cell, ys), adam)
        missing, _ = load_layout_checkpoint(step, directory)
        assert missing == [], missing
        losses = [float(step(ms.Tensor(xs)).asnumpy()) for _ in range(2)]
        close(losses, ref_losses[2:], f"resumed on {where}: steps 3-4")
        tp_size = world_size if where == "TP4" else 1
        for p in cell.trainable_params():
            close(p, _piece(ref_params[p.name], p.name, rank % tp_size, tp_size), f"{where}: {p.name}")
    return True
