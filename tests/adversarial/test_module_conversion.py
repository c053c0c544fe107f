"""Module conversions after parallelizing (SPEC §19, state changed after wrapping): ``Module.to(dtype)``
assigns each converted parameter through ``param.data = ...``; the DTensor's shard must convert with
its wrapper (it kept float32 while the parameter said float64, and the next matmul failed)."""
from tests.harness import run_dist


def _tp_then_double(rank, world_size):
    import torch
    from hyper_parallel import (ColwiseParallel, RowwiseParallel, init_device_mesh, parallelize_module)
    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
    model.load_state_dict(ref.state_dict())
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    model.double()
    ref.double()
    for p in model.parameters():
        assert p.dtype == p.to_local().dtype == torch.float64, (p.dtype, p.to_local().dtype)
    x = torch.randn(4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    out, expected = model(x), ref(x)
    torch.testing.assert_close(out, expected)
    out.sum().backward()
    expected.sum().backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.full_tensor(), q.grad, msg=lambda m: f"{name}: {m}")
    # a plain tensor has no layout: refused by name rather than half-assigned
    try:
        model[0].weight.data = torch.zeros(16, 8)
    except ValueError as error:
        assert "a DTensor's data can only be another DTensor" in str(error)
    else:
        raise AssertionError("assigning a plain tensor to a DTensor's .data was accepted")
    return True


def test_module_double_after_tensor_parallel_converts_the_shards():
    assert run_dist(2, _tp_then_double) == [True, True]
