"""The short causal convolution of GDN / KDA under context parallelism: each rank takes its
(kernel − 1)-token halo from the previous rank; forward and the input, weight and bias gradients
equal F.conv1d on the whole sequence (fp32 1e-5; weight / bias gradients summed over the ranks, as
the CP gradient reduction does), and gradcheck (fp64) holds on the global function."""
import pytest

from tests.harness import run_dist

TOL = {"atol": 1e-5, "rtol": 1e-5}


def _reference(x, weight, bias):
    import torch.nn.functional as F
    kernel = weight.shape[-1]
    return F.conv1d(x, weight.unsqueeze(1), bias, padding=kernel - 1, groups=x.shape[1])[..., :x.shape[-1]]


def _exact(rank, world_size, kernels):
    import torch
    from hyper_parallel import init_device_mesh
    from hyper_parallel.core.context_parallel.linear_attention.conv_halo import context_parallel_causal_conv1d
    from hyper_parallel.platform import get_platform
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
    gen = torch.Generator().manual_seed(2)
    for kernel in kernels:
        t = 4 * world_size
        x = torch.randn(2, 5, t, generator=gen, requires_grad=True)
        weight = torch.randn(5, kernel, generator=gen, requires_grad=True)
        bias = torch.randn(5, generator=gen, requires_grad=True)
        out = _reference(x, weight, bias)
        probe = torch.randn(out.shape, generator=gen)
        (out * probe).sum().backward()
        lo, hi = rank * 4, rank * 4 + 4
        mine = x.detach()[..., lo:hi].clone().requires_grad_()
        w, b = weight.detach().clone().requires_grad_(), bias.detach().clone().requires_grad_()
        block = context_parallel_causal_conv1d(mine, w, b, mesh)
        torch.testing.assert_close(block, out.detach()[..., lo:hi], **TOL)
        (block * probe[..., lo:hi]).sum().backward()
        torch.testing.assert_close(mine.grad, x.grad[..., lo:hi], **TOL)
        group = mesh.get_group()
        torch.testing.assert_close(get_platform().all_reduce(w.grad, group), weight.grad, **TOL)
        torch.testing.assert_close(get_platform().all_reduce(b.grad, group), bias.grad, **TOL)
    return len(kernels)


@pytest.mark.parametrize("world_size", [2, 4], ids=["cp2", "cp4"])
def test_conv_halo_exact(world_size):
    assert run_dist(world_size, _exact, [4, 2, 1, 5]) == [4] * world_size


def _gradcheck(rank, world_size):
    """The halo's backward is the derivative of its forward: x whole -> this rank's block -> conv
    -> the whole output (weight and bias fixed; their gradients are checked by ``_exact``)."""
    import torch
    from hyper_parallel import DTensor, Replicate, Shard, init_device_mesh
    from hyper_parallel.core.context_parallel.linear_attention.conv_halo import context_parallel_causal_conv1d
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
    gen = torch.Generator().manual_seed(4)
    weight = torch.randn(2, 4, generator=gen, dtype=torch.float64)
    bias = torch.randn(2, generator=gen, dtype=torch.float64)

    def conv(x):
        block = DTensor.from_local(x, mesh, [Replicate()]).redistribute(mesh, [Shard(2)]).to_local()
        out = context_parallel_causal_conv1d(block, weight, bias, mesh)
        return DTensor.from_local(out, mesh, [Shard(2)]).full_tensor()
    x = torch.randn(1, 2, 3 * world_size, generator=gen, dtype=torch.float64, requires_grad=True)
    return torch.autograd.gradcheck(conv, (x,), eps=1e-6, atol=1e-6)


@pytest.mark.parametrize("world_size", [2, 4], ids=["cp2", "cp4"])
def test_conv_halo_gradcheck(world_size):
    assert run_dist(world_size, _gradcheck) == [True] * world_size
