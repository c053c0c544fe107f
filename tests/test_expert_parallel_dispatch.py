"""The expert-parallel dispatch on its own (torch, gloo): a stacked-experts module split over 2 and 4
ranks against the dense computation of every rank's tokens in one process (outputs, gradients of
tokens, router scores and experts, averaged and summed), the collectives it issues (their count and
the bytes each rank sends against the closed form from the routing counts), the expert bytes per
rank, dropped assignments, bad input on every rank, and gradcheck of the dispatch in fp64."""
import pytest

from tests.harness import run_dist

E, H, INTER, K = 8, 6, 4, 2


class Experts:
    """Built inside a worker: a torch module with stacked SwiGLU experts (Hugging Face layout)."""

    @staticmethod
    def make(num_experts=E, dtype=None):
        import torch

        class StackedExperts(torch.nn.Module):
            def __init__(self):
                super().__init__()
                g = torch.Generator().manual_seed(7)
                self.gate_up_proj = torch.nn.Parameter(torch.randn(num_experts, 2 * INTER, H, generator=g))
                self.down_proj = torch.nn.Parameter(torch.randn(num_experts, H, INTER, generator=g))
                self.act_fn = torch.nn.SiLU()

            def forward(self, hidden, index, weights):   # the dense single-process reference
                out = torch.zeros_like(hidden)
                for k in range(index.shape[1]):
                    for e in range(num_experts):
                        rows = (index[:, k] == e).nonzero().flatten()
                        gate, up = (hidden[rows] @ self.gate_up_proj[e].T).chunk(2, -1)
                        y = (self.act_fn(gate) * up) @ self.down_proj[e].T
                        out = out.index_add(0, rows, y * weights[rows, k, None])
                return out
        module = StackedExperts()
        return module.to(dtype) if dtype is not None else module


def tokens(rank, count=10, dropped=False, dtype=None):
    """Rank ``rank``'s tokens, top-k expert indices (skewed towards expert 0: uneven splits) and scores."""
    import torch
    g = torch.Generator().manual_seed(1000 + rank)
    hidden = torch.randn(count, H, generator=g)
    index = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(count)])
    index[: count // 2, 0] = 0
    if dropped:
        index[1, 1] = E             # the "no expert" slot: contributes nothing
    weights = torch.rand(count, K, generator=g)
    if dtype is not None:
        hidden, weights = hidden.to(dtype), weights.to(dtype)
    return hidden, index, weights


def closed_form(counts, ep, rank, itemsize, hidden):
    """Bytes rank ``rank`` sends in one forward: the count exchange ((ep-1)/ep of E + ep int64) plus every
    row bound for another rank's experts, plus every row it returns to another rank."""
    import numpy as np
    counts = np.asarray(counts)                  # (ep ranks, E) assignments per expert
    local = E // ep
    sent = sum(counts[rank, d * local:(d + 1) * local].sum() for d in range(ep) if d != rank)
    returned = sum(counts[s, rank * local:(rank + 1) * local].sum() for s in range(ep) if s != rank)
    return (E + ep) * 8 * (ep - 1) // ep + int(sent + returned) * hidden * itemsize


def dispatch_case(rank, world_size, average, dropped):
    import torch
    from hyper_parallel import CommDebugMode, DTensor, ExpertParallel, init_device_mesh
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("ep",))
    module, ref = Experts.make(), Experts.make()
    ExpertParallel(average=average).apply(module, mesh)
    total = sum(p.numel() * p.element_size() for p in ref.parameters())
    held = sum(p.to_local().numel() * p.to_local().element_size() for p in module.parameters())
    assert all(isinstance(p, DTensor) for p in module.parameters()) and held <= 1.02 * total / world_size
    hidden, index, weights = tokens(rank, dropped=dropped)
    hidden.requires_grad_(True)
    weights.requires_grad_(True)
    module(hidden, index, weights)                  # first call: the settings agreement check
    with CommDebugMode() as comm:
        out = module(hidden, index, weights)
    counts = [torch.bincount(tokens(r, dropped=dropped)[1].flatten(), minlength=E + 1)[:E].tolist()
              for r in range(world_size)]
    assert comm.get_comm_counts() == {"all_to_all": 3}, comm.get_comm_counts()
    assert comm.get_total_bytes() == closed_form(counts, world_size, rank, 4, H)
    with CommDebugMode() as comm:
        (out * out).sum().backward()
    assert comm.get_comm_counts() == {"all_to_all": 2}, comm.get_comm_counts()
    count_exchange = (E + world_size) * 8 * (world_size - 1) // world_size      # forward only
    assert comm.get_total_bytes() == closed_form(counts, world_size, rank, 4, H) - count_exchange
    ref_loss = 0
    for r in range(world_size):
        h, i, w = tokens(r, dropped=dropped)
        h.requires_grad_(r == rank)
        w.requires_grad_(r == rank)
        y = ref(h, i, w)
        ref_loss = ref_loss + (y * y).sum()
        if r == rank:
            torch.testing.assert_close(out, y, atol=1e-5, rtol=1e-5)
            mine = (h, w)
    ref_loss.backward()
    torch.testing.assert_close(hidden.grad, mine[0].grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(weights.grad, mine[1].grad, atol=1e-5, rtol=1e-5)
    scale = 1.0 / world_size if average else 1.0
    for p, q in zip(module.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.full_tensor(), q.grad * scale, atol=1e-5, rtol=1e-5)
    return True


def _sample(rank, world_size):
    return [dispatch_case(rank, world_size, average, dropped)
            for average, dropped in ((True, False), (False, True))]


def test_dispatch_exact_bytes_counts():
    assert run_dist(2, _sample) == [[True, True]] * 2
    assert run_dist(4, _sample) == [[True, True]] * 4


def gradcheck_case(rank, world_size):
    """gradcheck in fp64 of the dispatch as a function of GLOBAL (replicated) inputs: each rank takes
    its block with a reduce-scatter / R and the outputs are all-gathered, so a perturbation means the
    same on every rank and the reverse all-to-all's gradients are checked across ranks."""
    import torch
    from hyper_parallel import get_platform, init_device_mesh
    from hyper_parallel.core.expert_parallel import dispatch_combine
    from hyper_parallel.core.expert_parallel.experts import grouped_compute
    platform = get_platform()
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("ep",))
    group, count = mesh.get_group(0), 3
    parts = [tokens(r, count=count, dtype=torch.float64) for r in range(world_size)]
    index = parts[rank][1]
    xg, wg = (torch.cat([p[j] for p in parts]).requires_grad_(True) for j in (0, 2))
    ref = Experts.make(dtype=torch.float64)
    gug, dg = (p.detach().clone().requires_grad_(True) for p in (ref.gate_up_proj, ref.down_proj))

    def mine(t):
        return platform.differentiable_reduce_scatter(t, group, 0) / world_size

    def fn(x, w, gate_up, down):
        local = {"gate_up_proj": mine(gate_up), "down_proj": mine(down)}
        y = dispatch_combine(mine(x), index, mine(w), E, group, world_size,
                             lambda rows, sizes: grouped_compute(ref, local, rows, sizes))
        return platform.differentiable_all_gather(y, group, 0)
    return torch.autograd.gradcheck(fn, (xg, wg, gug, dg), eps=1e-6, atol=1e-6)


def test_dispatch_gradcheck_fp64():
    assert run_dist(2, gradcheck_case) == [True, True]


def errors_case(rank, world_size):
    """Bad input raises the same ValueError on every rank, before any collective (none is counted)."""
    import torch
    from hyper_parallel import CommDebugMode, ExpertParallel, init_device_mesh
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("ep",))
    texts = []
    module = ExpertParallel().apply(Experts.make(num_experts=4), mesh)   # distributes (collectives)
    with CommDebugMode() as comm:
        for make in (lambda: ExpertParallel().apply(Experts.make(num_experts=5), mesh),
                     lambda: ExpertParallel().apply(Experts.make(), None),
                     lambda: ExpertParallel(average=1)):
            with pytest.raises(ValueError) as info:
                make()
            texts.append(str(info.value))
        hidden = tokens(rank)[0]
        with pytest.raises(ValueError) as info:
            module(hidden, torch.zeros(10, 5, dtype=torch.long), torch.ones(10, 5))
        texts.append(str(info.value))
    assert comm.get_total_counts() == 0
    assert "5 experts are not divisible by the ep size" in texts[0], texts[0]
    assert "pass a 1-D ep mesh" in texts[1] and "average=1" in texts[2]
    assert "top-k 5 exceeds the 4 experts" in texts[3], texts[3]
    return True


def disagree_case(rank, world_size):
    """Ranks routing with different top-k: every rank raises naming the setting (no hang)."""
    from hyper_parallel import ExpertParallel, init_device_mesh
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("ep",))
    module = ExpertParallel().apply(Experts.make(), mesh)
    hidden, index, weights = tokens(rank)
    if rank == 1:
        index, weights = index[:, :1].contiguous(), weights[:, :1].contiguous()
    with pytest.raises(ValueError, match="disagree on top_k"):
        module(hidden, index, weights)
    return True


def bad_index_case(rank, world_size):
    """A router index out of range on one rank only: every rank raises, naming that rank."""
    from hyper_parallel import ExpertParallel, init_device_mesh
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("ep",))
    module = ExpertParallel().apply(Experts.make(), mesh)
    hidden, index, weights = tokens(rank)
    module(hidden, index, weights)
    if rank == 1:
        index[3, 1] = E + 1
    with pytest.raises(ValueError, match=r"outside \[0, 8\] .* on group rank\(s\) \[1\]"):
        module(hidden, index, weights)
    return True


def test_bad_input_on_every_rank():
    assert run_dist(2, errors_case) == [True, True]
    assert run_dist(2, disagree_case) == [True, True]
    assert run_dist(2, bad_index_case) == [True, True]
