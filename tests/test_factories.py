"""DTensor factories, the mesh from ``with mesh:``, distribute_module replicating what
partition_fn leaves, a PyTorch-style ParallelStyle (``_apply``), and gradient placements of
``from_local`` / ``full_tensor`` — each against one process (fp32, exact or 1e-5)."""
from tests.harness import run_dist


def _factories_case(rank, world_size):
    import torch
    import hyper_parallel as hp
    from hyper_parallel import Partial, Replicate, Shard, init_device_mesh
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    layouts = [[Shard(0), Shard(1)], [Replicate(), Shard(0)], [Shard(1), Replicate()], [Partial(), Shard(1)]]
    for placements in layouts:
        for name, want in [("zeros", torch.zeros(5, 6)), ("ones", torch.ones(5, 6)),
                           ("full", torch.full((5, 6), 2.5))]:
            args = ((5, 6), 2.5) if name == "full" else (5, 6)
            dt = getattr(hp, name)(*args, device_mesh=mesh, placements=placements)
            assert dt.placements == tuple(p.normalized(2) for p in placements) and dt.shape == (5, 6)
            torch.testing.assert_close(dt.full_tensor(), want, rtol=0, atol=0, msg=f"{name} {placements}")
        for name in ("rand", "randn"):
            torch.manual_seed(11)
            dt = getattr(hp, name)(5, 6, device_mesh=mesh, placements=placements, requires_grad=True)
            torch.manual_seed(11)
            torch.testing.assert_close(dt.full_tensor(), getattr(torch, name)(5, 6), rtol=0, atol=0)
            assert dt.requires_grad
    assert hp.empty((4, 2), device_mesh=mesh, dtype=torch.float64).dtype == torch.float64
    # the mesh from `with mesh:` for factories, distribute_tensor and from_local
    tp = mesh["tp"]
    with tp:
        assert hp.zeros(4, placements=[Shard(0)]).device_mesh == tp
        assert hp.distribute_tensor(torch.ones(4), placements=[Shard(0)]).to_local().shape == (2,)
        assert hp.DTensor.from_local(torch.ones(2), placements=[Shard(0)]).shape == (4,)
    return True


def _module_case(rank, world_size):
    import torch
    from hyper_parallel import (ColwiseParallel, DTensor, ParallelStyle, Replicate, Shard, distribute_module,
                                distribute_tensor, init_device_mesh, parallelize_module)
    mesh = init_device_mesh("cpu", (world_size,))

    def partition(name, module, mesh):
        if isinstance(module, torch.nn.Linear):
            module.register_parameter("weight", torch.nn.Parameter(
                distribute_tensor(module.weight.detach(), mesh, [Shard(0)])))

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    distribute_module(model, mesh, partition)
    assert model[0].weight.placements == (Shard(0),)
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        assert isinstance(t, DTensor), name          # bias, norm weights, running stats: replicated
    assert model[1].running_mean.placements == (Replicate(),)

    class Colwise(ParallelStyle):                   # written against PyTorch's contract
        def _apply(self, module, device_mesh):
            return ColwiseParallel()._apply(module, device_mesh)

    torch.manual_seed(0)
    lin = parallelize_module(torch.nn.Linear(4, 8), mesh, Colwise())
    assert lin.weight.placements == (Shard(0),)
    torch.manual_seed(0)
    ref = torch.nn.Linear(4, 8)
    x = torch.randn(3, 4)
    torch.testing.assert_close(lin(x), ref(x)[:, rank * 8 // world_size:(rank + 1) * 8 // world_size])
    return True


def _grad_placements_case(rank, world_size):
    import torch
    from hyper_parallel import DTensor, Partial, Replicate, Shard, init_device_mesh
    mesh = init_device_mesh("cpu", (world_size,))
    # full_tensor(grad_placements=[Partial()]): each rank's gradient of the full value is a share;
    # the Shard(0) source gets the sum of the shares (its rows)
    base = torch.arange(8.0).reshape(4, 2)
    src = torch.randn(4, 2, requires_grad=True)
    dt = DTensor.from_local(src[rank * 4 // world_size:(rank + 1) * 4 // world_size], mesh, [Shard(0)])
    (dt.full_tensor(grad_placements=[Partial()]) * base * (rank + 1)).sum().backward()
    total = sum(r + 1 for r in range(world_size))
    torch.testing.assert_close(src.grad[rank * 4 // world_size:(rank + 1) * 4 // world_size],
                               (base * total)[rank * 4 // world_size:(rank + 1) * 4 // world_size])
    # from_local(grad_placements=[Partial()]): the local gradient arrives unreduced (a share)
    local = torch.ones(3, requires_grad=True)
    rep = DTensor.from_local(local, mesh, [Replicate()], grad_placements=[Partial()])
    (rep * 2.0).sum().backward()
    return local.grad.tolist()


def test_factories_and_with_mesh():
    assert run_dist(4, _factories_case) == [True] * 4


def test_distribute_module_parallel_style_and_grad_placements():
    assert run_dist(2, _module_case) == [True, True]
    shares = run_dist(2, _grad_placements_case)
    assert [a + b for a, b in zip(*shares)] == [2.0, 2.0, 2.0]   # the shares add up to one device's
