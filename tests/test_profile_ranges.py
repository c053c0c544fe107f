"""Profiler ranges (issue 38 point 6): under a torch.profiler trace, every collective and the context-
parallel and fully_shard phases appear as named ranges; with no profiler recording, profile_range
hands out one shared no-op context (nothing is allocated on the hot path)."""
from tests.harness import run_dist

CP_RANGES = {"hyper_parallel::context_parallel::prepare", "hyper_parallel::context_parallel::attention",
             "hyper_parallel::all_to_all_single"}
FSDP_RANGES = {"hyper_parallel::fully_shard::all_gather", "hyper_parallel::fully_shard::reduce_scatter",
               "hyper_parallel::all_gather", "hyper_parallel::reduce_scatter"}


def _traced_names(fn):
    import torch

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return {event.name for event in prof.events() if event.name.startswith("hyper_parallel::")}


def _cp_case(rank, world_size):
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    from hyper_parallel import ContextParallel, init_device_mesh, parallelize_module

    class Attention(nn.Module):
        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                  is_causal=True).transpose(1, 2)

    mesh = init_device_mesh("cpu", (world_size,))
    attn = parallelize_module(Attention(), mesh, ContextParallel())
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4 * world_size, 2, 4, generator=g).chunk(world_size, 1)[rank] for _ in range(3))
    attn(q, k, v)   # the first call's checks run outside the trace
    return sorted(_traced_names(lambda: attn(q, k, v)))


def _fully_shard_case(rank, world_size):
    from hyper_parallel import init_device_mesh
    from tests.fully_shard_models import batch, loss_fn, net, shard_net

    mesh = init_device_mesh("cpu", (world_size,))
    model = shard_net(net(), mesh)

    def step():
        loss_fn(model(batch(0, rank))).backward()

    step()
    names = _traced_names(step)
    model.zero_grad(set_to_none=True)
    return sorted(names)


def _no_profiler_case():
    from hyper_parallel.platform import get_platform

    platform = get_platform()
    first, second = platform.profile_range("a"), platform.profile_range("b")
    with first:
        pass
    return first is second


def test_context_parallel_call_is_traced_in_named_ranges():
    for names in run_dist(2, _cp_case):
        assert CP_RANGES <= set(names), names


def test_fully_shard_step_is_traced_in_named_ranges():
    for names in run_dist(2, _fully_shard_case):
        assert FSDP_RANGES <= set(names), names


def test_no_profiler_means_one_shared_no_op_range():
    assert _no_profiler_case()
