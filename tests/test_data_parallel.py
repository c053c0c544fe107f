"""data_parallel: gradients all-reduced over dp / cp / flattened dp×cp meshes, TP DTensor parameters,
no_sync accumulation, average vs sum — against one process computing every rank's batch."""
import pytest

from tests.harness import run_dist


def _mlp(torch):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def _batch(torch, rank, rows=3):
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(rows, 8, generator=g)


def _reference_grads(torch, ranks, weights):
    """Gradients of sum_r weights[r] * loss(batch_r) on one process."""
    model = _mlp(torch)
    total = sum(w * model(_batch(torch, r)).pow(2).sum() for r, w in zip(ranks, weights))
    total.backward()
    return [p.grad.clone() for p in model.parameters()]


def _check(torch, model, expected, what):
    for (name, p), g in zip(model.named_parameters(), expected):
        torch.testing.assert_close(p.grad, g, atol=1e-5, rtol=1e-5, msg=lambda m: f"{what} {name}: {m}")


def _check_overlap(torch, mesh, rank):
    """The last layer's bucket is launched while backward still runs (before the input's gradient)."""
    from hyper_parallel import data_parallel, get_platform
    events = []

    def observer(op, nbytes, ranks):
        events.append(op)
    model = data_parallel(_mlp(torch), mesh, bucket_mb=1e-4)
    x = _batch(torch, rank).requires_grad_()
    x.register_hook(lambda g: events.append("input grad"))
    get_platform().add_comm_observer(observer)
    try:
        model(x).pow(2).sum().backward()
    finally:
        get_platform().remove_comm_observer(observer)
    assert events.index("dp_all_reduce") < events.index("input grad"), events


def _dp_meshes(rank, world_size):
    """Plain models on a dp mesh, on a flattened dp×cp mesh, average and sum, no_sync accumulation,
    small buckets (several per model, overlapping backward), an unused parameter."""
    import torch
    from hyper_parallel import data_parallel, init_device_mesh

    root = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("dp", "cp"))
    _check_overlap(torch, root["dp"], rank)
    cases = [("dp", root["dp"]), ("dpcp", root["dp", "cp"].flatten("dpcp"))]
    for label, mesh in cases:
        ranks = mesh.group_ranks(0)
        for average in (True, False):
            model = data_parallel(_mlp(torch), mesh, average=average, bucket_mb=1e-4)
            assert len(model._hp_grad_reducer.buckets) > 1
            model(_batch(torch, rank)).pow(2).sum().backward()
            w = 1.0 / len(ranks) if average else 1.0
            _check(torch, model, _reference_grads(torch, ranks, [w] * len(ranks)), f"{label} avg={average}")
        # gradient accumulation: two micro-batches, the first under no_sync
        model = data_parallel(_mlp(torch), mesh, average=False)
        with model.no_sync():
            model(_batch(torch, rank)).pow(2).sum().backward()
        local = [p.grad.clone() for p in model.parameters()]
        ref_one = _reference_grads(torch, [rank], [1.0])
        for a, b in zip(local, ref_one):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)  # no_sync: nothing reduced
        model(_batch(torch, rank + 50)).pow(2).sum().backward()
        ref = _reference_grads(torch, ranks, [1.0] * len(ranks))
        ref2 = _reference_grads(torch, [r + 50 for r in ranks], [1.0] * len(ranks))
        _check(torch, model, [a + b for a, b in zip(ref, ref2)], f"{label} no_sync")
    # a parameter used on rank 0 only: the others receive its gradient, an everywhere-unused one stays
    # None; one used on rank 0 only whose gradient is exactly zero gets zeros everywhere, as in one
    # process (AdamW then still decays it and advances its moments)
    mesh = root["dp"]
    model = _mlp(torch)
    model.extra = torch.nn.Linear(8, 1)
    model.never = torch.nn.Linear(8, 1)
    model.zero = torch.nn.Linear(8, 1)
    data_parallel(model, mesh, average=False)
    out = model[2](model[1](model[0](_batch(torch, rank)))).pow(2).sum()
    if mesh.get_local_rank() == 0:
        out = out + model.extra(_batch(torch, rank)).sum() + 0 * model.zero(_batch(torch, rank)).sum()
    out.backward()
    expected = _batch(torch, mesh.group_ranks(0)[0]).sum(0, keepdim=True)
    torch.testing.assert_close(model.extra.weight.grad, expected)
    assert model.never.weight.grad is None
    torch.testing.assert_close(model.zero.weight.grad, torch.zeros(1, 8))
    return True


def test_data_parallel_dp_and_flattened_dp_cp():
    assert run_dist(4, _dp_meshes) == [True] * 4


def _tp_params(rank, world_size):
    """Colwise/Rowwise TP on "tp" plus data_parallel on "dp": DTensor grads reduce their local shard
    over dp; DTensors on the dp mesh itself are rejected."""
    import torch
    from hyper_parallel import (ColwiseParallel, DTensor, RowwiseParallel, data_parallel, init_device_mesh,
                                parallelize_module)

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_index = mesh["dp"].get_local_rank()  # the two TP ranks of one dp index see the same batch
    for average in (True, False):
        model = parallelize_module(_mlp(torch), mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        data_parallel(model, mesh["dp"], average=average)
        model(_batch(torch, dp_index)).pow(2).sum().backward()
        w = 1.0 / 2 if average else 1.0
        expected = _reference_grads(torch, [0, 1], [w, w])
        for (name, p), g in zip(model.named_parameters(), expected):
            grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            torch.testing.assert_close(grad, g, atol=1e-5, rtol=1e-5, msg=lambda m: f"tp {name}: {m}")
    bad = parallelize_module(_mlp(torch), mesh["tp"], {"0": ColwiseParallel()})
    with pytest.raises(ValueError, match="shares ranks"):
        data_parallel(bad, mesh["tp"])
    with pytest.raises(ValueError, match="1-D mesh"):
        data_parallel(_mlp(torch), mesh)
    return True


def test_data_parallel_with_tensor_parallel_params():
    assert run_dist(4, _tp_params) == [True] * 4
