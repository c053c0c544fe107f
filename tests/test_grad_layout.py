"""The memory layout of DTensor gradients (docs/dtensor.md, "Gradient memory layout"): an
activation's gradient that arrives dense but permuted (a transpose's) is passed on as it is, not
copied; a parameter's ``.grad`` still has the parameter's layout, so that optimizers reading it in
memory order (PyTorch's fused CPU AdamW) step it right. Both on the full dispatcher (first call) and
the fast path (second call), with values equal to one device's."""
from tests.harness import run_dist

TOL = {"atol": 1e-6, "rtol": 1e-6}


def _case(rank, world):
    import torch
    from hyper_parallel import Replicate, Shard, distribute_tensor, init_device_mesh
    mesh = init_device_mesh("cpu", (world,))
    gen = torch.Generator().manual_seed(0)
    x_full, w_full, c_full = (torch.randn(4 * world, 6, generator=gen) for _ in range(3))
    w_ref = torch.nn.Parameter(w_full.clone())
    opt_ref = torch.optim.AdamW([w_ref], lr=0.1, fused=True)
    w = torch.nn.Parameter(distribute_tensor(w_full, mesh, [Replicate()]))
    opt = torch.optim.AdamW([w], lr=0.1, fused=True)
    for _ in range(2):   # the first call on the full dispatcher, the second on the fast path
        x_ref = x_full.clone().requires_grad_()
        ((x_ref * 2.0 @ w_ref.t()) * (c_full @ c_full.t())).sum().backward()
        x = distribute_tensor(x_full, mesh, [Replicate()]).requires_grad_()
        c = distribute_tensor(c_full @ c_full.t(), mesh, [Replicate()])
        ((x * 2.0 @ w.t()) * c).sum().backward()
        local = w.grad._local_tensor
        assert local.is_contiguous(), local.stride()
        torch.testing.assert_close(x.grad.full_tensor(), x_ref.grad, **TOL)
        torch.testing.assert_close(w.grad.full_tensor(), w_ref.grad, **TOL)
        opt.step()
        opt_ref.step()
        torch.testing.assert_close(w.full_tensor(), w_ref.detach(), **TOL)
        opt.zero_grad()
        opt_ref.zero_grad()


def test_a_leaf_gets_a_contiguous_gradient_through_a_transpose():
    """w.t()'s backward hands the parameter w a transposed gradient; what w accumulates is contiguous
    and two fused AdamW steps equal one device's (a plain parameter given the transposed view as its
    .grad was 0.4 off after two steps)."""
    run_dist(2, _case, timeout=120)


def _transpose_case(rank, world):
    import torch
    from hyper_parallel import Replicate, Shard, distribute_tensor, init_device_mesh
    mesh = init_device_mesh("cpu", (world,))
    gen = torch.Generator().manual_seed(1)
    x_full, c_full = torch.randn(4 * world, 6, generator=gen), torch.randn(6, 4 * world, generator=gen)
    seen = []
    for _ in range(2):
        x = distribute_tensor(x_full, mesh, [Shard(0)]).requires_grad_()
        act = x * 2.0
        act.register_hook(lambda g: seen.append((g._local_tensor.is_contiguous(), g._local_tensor.stride())))
        (act.t() * distribute_tensor(c_full, mesh, [Shard(1)])).sum().backward()
        torch.testing.assert_close(x.grad.full_tensor(), 2.0 * c_full.t(), **TOL)
        assert x.grad._local_tensor.is_contiguous()
    return seen


def test_a_transposes_gradient_reaches_the_activation_uncopied():
    """act.t()'s backward hands act a transposed view of the gradient: it arrives as that view
    (strides (1, rows)), on the full dispatcher and the fast path; the leaf x still gets a
    contiguous gradient."""
    for seen in run_dist(2, _transpose_case, timeout=120):
        assert [contiguous for contiguous, _ in seen] == [False, False], seen
        assert all(stride == (1, 4) for _, stride in seen), seen
