"""ContextParallel's steady state: a call with the same input signature as an earlier one sends
nothing beyond the mode's own collectives (the cross-rank shape check runs on a new signature, or
on every call with HP_CP_DEBUG=1), and its results are unchanged."""
import pytest

from tests.harness import run_dist

MODES = {"ulysses": {}, "allgather": {"ulysses_degree": 1},
         "ring": {"ulysses_degree": 1, "kv_exchange": "ring"}}


def steady_state(rank, world_size, mode):
    import os

    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    from hyper_parallel import CommDebugMode, ContextParallel, init_device_mesh, parallelize_module

    class Attention(nn.Module):
        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                  is_causal=True).transpose(1, 2)

    saved = os.environ.pop("HP_CP_DEBUG", None)  # the default mode (the suite runs in debug mode)
    try:
        mesh = init_device_mesh("cpu", (world_size,))
        attn = parallelize_module(Attention(), mesh, ContextParallel(**MODES[mode]))
        g = torch.Generator().manual_seed(3)
        q, k, v = (torch.randn(2, 8 * world_size, 4, 8, generator=g) for _ in range(3))
        block = [t.chunk(world_size, 1)[rank] for t in (q, k, v)]
        counts = []
        for call in range(3):
            with CommDebugMode() as comm:
                out = attn(*block)
            counts.append(comm.get_comm_counts())
            want = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)),
                                                  is_causal=True).transpose(1, 2)
            torch.testing.assert_close(out, want.chunk(world_size, 1)[rank], atol=1e-5, rtol=1e-5)
        assert "shape_check" in counts[0], counts[0]
        for later in counts[1:]:
            assert "shape_check" not in later, later
            assert later == {op: n for op, n in counts[0].items() if op != "shape_check"}, (counts[0], later)
        os.environ["HP_CP_DEBUG"] = "1"
        with CommDebugMode() as comm:
            attn(*block)
        assert "shape_check" in comm.get_comm_counts()  # debug mode checks every call
    finally:
        os.environ.pop("HP_CP_DEBUG", None)
        if saved is not None:
            os.environ["HP_CP_DEBUG"] = saved
    return counts[1]


@pytest.mark.parametrize("mode", sorted(MODES))
def test_steady_state_sends_only_the_modes_collectives(mode):
    results = run_dist(2, steady_state, mode)
    assert results[0] == results[1] and results[0]
