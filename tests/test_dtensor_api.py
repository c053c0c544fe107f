"""DTensor API (SPEC §4): from_local / to_local / full_tensor, metadata, distribute_tensor,
distribute_module, DTensor parameters under torch.optim, backward on a DTensor loss.

Checks run on 4 ranks and are grouped into a few ``run_dist`` cases; references are single-process
torch computed on every rank from the same seeds. The conversions of every placement pair and
distribute_tensor are platform-neutral (tests/cases/dtensor.py) and also run on MindSpore.
"""
import pytest

from tests.cases import dtensor as neutral
from tests.harness import run_dist
from tests.harness.frameworks import FRAMEWORKS, framework_worlds, run_on

TOL = {"atol": 1e-5, "rtol": 1e-5}


# ============================================================================ construction, metadata
def _construction(rank, world_size):
    import torch
    from hyper_parallel.core.comm_mode import CommDebugMode
    from hyper_parallel.core.dtensor import (DTensor, Partial, Replicate, Shard, distribute_tensor,
                                             init_device_mesh)

    mesh = init_device_mesh("cpu", (4,))
    mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    full = torch.arange(15.0).reshape(5, 3)

    # ---- even shards: the global shape is inferred
    even = torch.arange(24.0).reshape(8, 3)
    dt = DTensor.from_local(even.chunk(4)[rank], mesh, [Shard(0)])
    assert isinstance(dt, DTensor) and isinstance(dt, torch.Tensor)
    assert dt.shape == torch.Size([8, 3]) and dt.size() == torch.Size([8, 3])
    assert dt.size(0) == 8 and dt.size(-1) == 3 and dt.ndim == 2 and dt.dim() == 2
    assert dt.numel() == 24 and dt.dtype == torch.float32 and dt.device == torch.device("cpu")
    assert dt.local_shape == (2, 3) and dt.placements == (Shard(0),) and dt.device_mesh is mesh
    torch.testing.assert_close(dt.full_tensor(), even)
    torch.testing.assert_close(dt.to_local(), even.chunk(4)[rank])

    # ---- uneven shards need shape=; torch.chunk pieces (5 rows -> 2, 2, 1, 0)
    pieces = list(full.chunk(4)) + [full[:0]]
    dt = DTensor.from_local(pieces[rank], mesh, [Shard(0)], shape=(5, 3), run_check=True)
    assert dt.shape == torch.Size([5, 3]) and dt.numel() == 15
    assert dt.local_shape == ((2, 3), (2, 3), (1, 3), (0, 3))[rank]
    torch.testing.assert_close(dt.full_tensor(), full)

    # ---- run_check: every rank raises on an inconsistent layout
    with pytest.raises(ValueError):  # wrong global shape for these pieces (rank 2 holds 1 row)
        DTensor.from_local(pieces[rank], mesh, [Shard(0)], shape=(6, 3), run_check=True)
    with pytest.raises(ValueError):  # ranks disagree on the inferred global shape
        DTensor.from_local(torch.zeros(3 if rank == 0 else 2, 3), mesh, [Shard(0)], run_check=True)
    with pytest.raises(ValueError):  # replicated pieces of different shapes
        DTensor.from_local(torch.zeros(2, 2 + (rank == 3)), mesh, [Replicate()], run_check=True)
    with pytest.raises(ValueError):  # one placement per mesh dim
        DTensor.from_local(torch.zeros(2, 2), mesh, [Shard(0), Shard(1)])
    DTensor.from_local(torch.zeros(2, 2), mesh, [Replicate()], run_check=True)  # consistent: fine

    # ---- negative dims are normalised against the tensor's rank
    dt = DTensor.from_local(torch.ones(2, 3, 1), mesh, [Shard(-1)])
    assert dt.placements == (Shard(2),) and dt.shape == torch.Size([2, 3, 4])
    dt = distribute_tensor(full, mesh, [Shard(-1)], src_data_rank=None)
    assert dt.placements == (Shard(1),) and dt.local_shape == ((5, 1) if rank < 3 else (5, 0))
    torch.testing.assert_close(dt.full_tensor(), full)

    # ---- 2-D mesh metadata
    dt = distribute_tensor(full, mesh2, [Shard(0), Shard(1)])
    dp, tp = mesh2.get_coordinate()
    assert dt.local_shape == tuple(full.chunk(2, 0)[dp].chunk(2, 1)[tp].shape)
    assert dt.device_mesh is mesh2 and dt.placements == (Shard(0), Shard(1))
    torch.testing.assert_close(dt.to_local(), full.chunk(2, 0)[dp].chunk(2, 1)[tp])
    torch.testing.assert_close(dt.full_tensor(), full)

    # ---- redistribute argument errors; an identical layout is returned as is
    with pytest.raises(ValueError):
        dt.redistribute(mesh, [Replicate()])  # another mesh
    with pytest.raises(ValueError):
        dt.redistribute(mesh2)  # no placements
    assert dt.redistribute(mesh2, [Shard(0), Shard(-1)]) is dt

    # ---- Partial pieces reduce in full_tensor
    for op, local, want in [("sum", full * (rank + 1), full * 10), ("avg", full * (rank + 1), full * 2.5),
                            ("max", full + rank, full + 3), ("min", full - rank, full - 3)]:
        dt = DTensor.from_local(local, mesh, [Partial(op)])
        assert dt.placements == (Partial(op),) and dt.shape == full.shape
        torch.testing.assert_close(dt.full_tensor(), want)

    # ---- distribute_tensor: the data really comes from src_data_rank
    def own(r):
        return torch.arange(40.0).reshape(8, 5) + 1000 * r  # every rank holds different data
    for src in (0, 1, 3):
        for placements in ([Shard(0)], [Replicate()], [Shard(1)]):
            dt = distribute_tensor(own(rank), mesh, placements, src_data_rank=src)
            torch.testing.assert_close(dt.full_tensor(), own(src))
        dt = distribute_tensor(own(rank), mesh2, [Shard(1), Replicate()], src_data_rank=src)
        torch.testing.assert_close(dt.full_tensor(), own(src))
        assert dt.placements == (Shard(1), Replicate())
    # src_data_rank=None: each rank slices its own copy; no data travels, only the metadata check
    with CommDebugMode() as comm:
        dt = distribute_tensor(own(rank), mesh, [Shard(0)], src_data_rank=None)
        dt2 = distribute_tensor(own(rank), mesh2, [Shard(0), Shard(1)], src_data_rank=None)
        dt3 = distribute_tensor(own(rank), mesh, [Replicate()], src_data_rank=None)
    assert set(comm.get_comm_counts()) <= {"shape_check"}, comm.get_comm_counts()
    torch.testing.assert_close(dt.to_local(), own(rank).chunk(4)[rank])
    torch.testing.assert_close(dt2.to_local(), own(rank).chunk(2, 0)[dp].chunk(2, 1)[tp])
    torch.testing.assert_close(dt3.to_local(), own(rank))
    with CommDebugMode() as comm:
        distribute_tensor(own(rank), mesh, [Shard(0)], src_data_rank=0)
    if rank == 0:
        assert comm.get_comm_counts().get("broadcast", 0) >= 1  # the source's data has to travel
    with pytest.raises(ValueError):
        distribute_tensor(own(rank), mesh, [Shard(0)], src_data_rank=7)
    # requires_grad carries over, and the result is a leaf
    dt = distribute_tensor(torch.ones(4, 4, requires_grad=True), mesh, [Shard(0)])
    assert dt.requires_grad and dt.is_leaf
    return True


def test_construction_and_metadata():
    assert run_dist(4, _construction) == [True] * 4


def test_placement_reprs_and_equality():
    from hyper_parallel.core.dtensor import Partial, Replicate, Shard
    assert [repr(p) for p in (Shard(1), Replicate(), Partial(), Partial("avg"))] == \
        ["S(1)", "R", "P(sum)", "P(avg)"]
    assert Shard(1) == Shard(1) and hash(Shard(1)) == hash(Shard(1)) and Shard(1) != Shard(-1)
    assert Shard(-1).normalized(2) == Shard(1)
    assert {Replicate(), Replicate()} == {Replicate()}
    assert Partial("sum") == Partial() and hash(Partial("sum")) == hash(Partial())


# ============================================================================ autograd through conversions
def _conversions_grad(rank, world_size):
    import torch
    from hyper_parallel.core.dtensor import DTensor, Partial, Replicate, Shard, init_device_mesh

    mesh = init_device_mesh("cpu", (4,))
    weights = [torch.arange(6.0).reshape(2, 3) + 10 * r for r in range(4)]

    # from_local -> to_local round trip: the local gradient comes straight back
    local = torch.randn(2, 3, requires_grad=True)
    dt = DTensor.from_local(local, mesh, [Shard(0)])
    assert dt.requires_grad and not dt.is_leaf
    out = dt.to_local()
    assert not isinstance(out, DTensor)
    (out * weights[rank]).sum().backward()
    torch.testing.assert_close(local.grad, weights[rank])

    # a Replicate value's gradient is replicated, not summed over the replicas
    local = torch.randn(2, 3, requires_grad=True)
    (DTensor.from_local(local, mesh, [Replicate()]).to_local() * weights[rank]).sum().backward()
    torch.testing.assert_close(local.grad, weights[rank])

    # grad_placements=[Partial()]: each rank's local gradient is a partial sum -> summed
    local = torch.randn(2, 3, requires_grad=True)
    (DTensor.from_local(local, mesh, [Replicate()]).to_local(grad_placements=[Partial()])
     * weights[rank]).sum().backward()
    torch.testing.assert_close(local.grad, sum(weights))

    # through full_tensor: the replicated gradient is sliced back to the shard
    full = torch.randn(8, 3)
    local = full.chunk(4)[rank].clone().requires_grad_()
    w = torch.randn(8, 3, generator=torch.Generator().manual_seed(5))
    (DTensor.from_local(local, mesh, [Shard(0)]).full_tensor() * w).sum().backward()
    torch.testing.assert_close(local.grad, w.chunk(4)[rank])

    # uneven shard with shape=: gradient of the 1-row and empty shards
    full = torch.randn(5, 3)
    pieces = list(full.chunk(4)) + [full[:0]]
    local = pieces[rank].clone().requires_grad_()
    w = torch.randn(5, 3, generator=torch.Generator().manual_seed(6))
    (DTensor.from_local(local, mesh, [Shard(0)], shape=(5, 3)).full_tensor() * w).sum().backward()
    w_pieces = list(w.chunk(4)) + [w[:0]]
    torch.testing.assert_close(local.grad, w_pieces[rank])

    # a Partial source: the gradient of each piece is the replicated gradient
    local = torch.randn(2, 3, requires_grad=True)
    (DTensor.from_local(local, mesh, [Partial()]).full_tensor() * weights[0]).sum().backward()
    torch.testing.assert_close(local.grad, weights[0])

    # no autograd when nothing requires grad
    dt = DTensor.from_local(torch.randn(2, 3), mesh, [Shard(0)])
    assert not dt.requires_grad and dt.to_local().grad_fn is None
    return True


def test_from_local_to_local_autograd():
    assert run_dist(4, _conversions_grad) == [True] * 4


# ============================================================================ modules and optimizers
def _shard_linear(name, module, mesh):
    """partition_fn: Linear weight and bias sharded on the output features."""
    import torch
    from hyper_parallel.core.dtensor import Shard, distribute_tensor
    if isinstance(module, torch.nn.Linear):
        module.weight = torch.nn.Parameter(distribute_tensor(module.weight.data, mesh, [Shard(0)]))
        if module.bias is not None:
            module.bias = torch.nn.Parameter(distribute_tensor(module.bias.data, mesh, [Shard(0)]))


def _to_dtensor_input(module, inputs, mesh):
    from hyper_parallel.core.dtensor import DTensor, Replicate
    return tuple(DTensor.from_local(x, mesh, [Replicate()] * mesh.ndim) for x in inputs)


def _to_full_output(module, outputs, mesh):
    return outputs.full_tensor()


def _modules_and_optim(rank, world_size):
    import copy

    import torch
    from hyper_parallel.core.dtensor import DTensor, Replicate, Shard, distribute_module, init_device_mesh

    mesh = init_device_mesh("cpu", (4,))
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(6, 7), torch.nn.Tanh(), torch.nn.Linear(7, 5))
    x = torch.randn(3, 6)

    # ---- default partition: every parameter replicated
    model = distribute_module(copy.deepcopy(base), mesh)
    for name, p in model.named_parameters():
        assert isinstance(p, torch.nn.Parameter) and isinstance(p, DTensor), name
        assert p.placements == (Replicate(),) and p.requires_grad, name
        torch.testing.assert_close(p.full_tensor(), dict(base.named_parameters())[name].detach())
    out = model(DTensor.from_local(x, mesh, [Replicate()]))
    torch.testing.assert_close(out.full_tensor(), base(x), **TOL)

    # ---- partition_fn + input_fn + output_fn
    model = distribute_module(copy.deepcopy(base[0]), mesh, partition_fn=_shard_linear,
                              input_fn=_to_dtensor_input, output_fn=_to_full_output)
    assert model.weight.placements == (Shard(0),) and model.bias.placements == (Shard(0),)
    assert model.weight.local_shape == ((2, 6), (2, 6), (2, 6), (1, 6))[rank]
    out = model(x)  # plain in (input_fn wraps it), plain out (output_fn gathers it)
    assert not isinstance(out, DTensor)
    torch.testing.assert_close(out, base[0](x), **TOL)

    # ---- optimizer steps on DTensor parameters == single process
    results = {}
    for opt_name in ("SGD", "AdamW"):
        ref = copy.deepcopy(base)
        dist_model = distribute_module(copy.deepcopy(base), mesh, partition_fn=_shard_linear)

        def make(params):
            if opt_name == "SGD":
                return torch.optim.SGD(params, lr=0.1, momentum=0.9)
            return torch.optim.AdamW(params, lr=0.05, weight_decay=0.1)
        opt_ref, opt_dist = make(ref.parameters()), make(dist_model.parameters())
        for step in range(3):
            xs = torch.randn(4, 6, generator=torch.Generator().manual_seed(step))
            loss_ref = (ref(xs) ** 2).sum()
            loss_ref.backward()
            loss = (dist_model(DTensor.from_local(xs, mesh, [Replicate()])) ** 2).sum()
            assert isinstance(loss, DTensor) and loss.ndim == 0
            loss.backward()
            torch.testing.assert_close(loss.full_tensor(), loss_ref.detach(), **TOL)
            for (name, p), q in zip(dist_model.named_parameters(), ref.parameters()):
                assert isinstance(p.grad, DTensor), (opt_name, name, type(p.grad))
                assert p.grad.placements == p.placements, (opt_name, name, p.grad.placements)
                torch.testing.assert_close(p.grad.full_tensor(), q.grad, **TOL)
            opt_ref.step()
            opt_dist.step()
            opt_ref.zero_grad()
            opt_dist.zero_grad()
        for (name, p), q in zip(dist_model.named_parameters(), ref.parameters()):
            assert isinstance(p, DTensor) and p.placements in ((Shard(0),), (Replicate(),)), name
            torch.testing.assert_close(p.full_tensor(), q.detach(), **TOL,
                                       msg=lambda m: f"{opt_name} {name}: {m}")
        results[opt_name] = True

    # ---- gradients accumulate over two backward calls
    ref = copy.deepcopy(base)
    dist_model = distribute_module(copy.deepcopy(base), mesh, partition_fn=_shard_linear)
    for i in range(2):
        xs = torch.randn(4, 6, generator=torch.Generator().manual_seed(10 + i))
        (ref(xs) ** 2).sum().backward()
        (dist_model(DTensor.from_local(xs, mesh, [Replicate()])) ** 2).sum().backward()
    once = copy.deepcopy(base)
    (once(torch.randn(4, 6, generator=torch.Generator().manual_seed(10))) ** 2).sum().backward()
    for (name, p), q, q1 in zip(dist_model.named_parameters(), ref.parameters(), once.parameters()):
        assert not torch.allclose(q.grad, q1.grad)  # the reference did accumulate
        torch.testing.assert_close(p.grad.full_tensor(), q.grad, **TOL, msg=lambda m: f"accum {name}: {m}")
        assert p.grad.placements == p.placements

    # ---- backward() on a scalar DTensor loss from a sharded leaf
    w = torch.randn(8, 3, generator=torch.Generator().manual_seed(3))
    leaf = DTensor.from_local(w.chunk(4)[rank].clone(), mesh, [Shard(0)]).requires_grad_()
    loss = (leaf * leaf).sum()
    assert isinstance(loss, DTensor) and loss.shape == torch.Size([])
    loss.backward()
    assert leaf.grad.placements == (Shard(0),)
    torch.testing.assert_close(leaf.grad.to_local(), 2 * w.chunk(4)[rank])
    torch.testing.assert_close(loss.full_tensor(), (w * w).sum())
    return results


def test_modules_optimizers_backward():
    assert run_dist(4, _modules_and_optim, timeout=180) == [{"SGD": True, "AdamW": True}] * 4


# ============================================================================ on every framework
@pytest.mark.parametrize("framework,world_size", framework_worlds(2, 4))
def test_conversions_every_placement_pair(framework, world_size):
    """from_local / redistribute / to_local for every pair of placements (1-D, and 2x2 on 4 ranks;
    even and uneven shapes), forward and backward; full_tensor; run_check
    (tests/cases/dtensor.py, on torch and MindSpore)."""
    # MindSpore (slow on 2 cores) checks a covering sample of the 196 pairs of the 2x2 mesh
    counts = run_on(framework, world_size, neutral.conversions, framework == "torch", timeout=280)
    assert counts[0] == counts[-1] and counts[0] >= 32


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_distribute_tensor_from_one_or_every_rank(framework):
    assert run_on(framework, 2, neutral.distribute) == [True, True]
