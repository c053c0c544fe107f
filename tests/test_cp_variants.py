"""Attention variants under ContextParallel (SPEC §12): logit soft-capping, attention sinks and a
sliding window through ``hyper_parallel.attention``, in every mode, with and without
``attention_masks`` (packed documents).

Every rank builds the full q, k, v, the sink logits and an output weight from one seed. The
reference is an eager formula written here (scores, c·tanh(s/c), the masks, the sinks as an extra
logit column, softmax), independent of the library. Each rank's contiguous block then runs through
the ContextParallel module; its output, dq/dk/dv blocks (fp32, 1e-5) and the sinks' gradient summed
over the ranks must match (each rank's sinks gradient is its share, as for every parameter under
context parallelism).
"""
import pytest

from tests.harness import run_dist
from tests.harness.frameworks import framework_worlds, run_on

B, S, HQ, HKV, D = 2, 16, 4, 2, 4
TOL = {"atol": 1e-5, "rtol": 1e-5}
MODES = {
    "ulysses": {}, "allgather": {"ulysses_degree": 1},
    "allgather_lb": {"ulysses_degree": 1, "load_balance": True},
    "ring": {"ulysses_degree": 1, "kv_exchange": "ring"},
    "zigzag": {"ulysses_degree": 1, "kv_exchange": "ring", "load_balance": True},
    "hybrid": {"ulysses_degree": 2}, "hybrid_ring": {"ulysses_degree": 2, "kv_exchange": "ring"},
    "ulysses_overlap": {"overlap": True},
}
VARIANTS = {   # name -> hyper_parallel.attention keywords (sinks: True = a learned logit per head)
    "softcap": {"softcap": 0.8},
    "sinks": {"sinks": True},
    "softcap_sinks": {"softcap": 1.5, "sinks": True},
    "softcap_bidirectional": {"softcap": 0.8, "causal": False},
    "window": {"window": 5},          # shorter than a rank's block at cp=2 (8), longer at cp=4 (4)
    "window_short": {"window": 2},    # a zigzag chunk's length at cp=4 (2)
    "window_all": {"window": 3, "softcap": 0.8, "sinks": True},
}
DOCS = [[3, 6, 1, 6], [9, 2, 5]]   # packed document lengths per batch row


def reference(q, k, v, causal=True, softcap=None, sinks=None, window=None, documents=None):
    """Single-device attention by the definition, on (B, H, S, D)."""
    import torch
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    i, j = torch.arange(q.shape[2]).unsqueeze(1), torch.arange(k.shape[2]).unsqueeze(0)
    allowed = torch.ones(q.shape[0], 1, q.shape[2], k.shape[2], dtype=torch.bool)
    if causal:
        allowed = allowed & (j <= i)
    if window is not None:
        allowed = allowed & (j > i - window)
    if documents is not None:
        allowed = allowed & (documents.unsqueeze(-1) == documents.unsqueeze(-2)).unsqueeze(1)
    s = s.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.reshape(1, -1, 1, 1).expand(s.shape[0], -1, s.shape[2], 1)], -1)
    p = torch.softmax(s, -1)
    return (p[..., :-1] if sinks is not None else p) @ v


def _documents():
    import torch
    return torch.tensor([[d for d, n in enumerate(row) for _ in range(n)] for row in DOCS])


class _Core:
    """A core-attention module calling hyper_parallel.attention (BNSD), with sinks as a parameter."""

    def __new__(cls, options):
        import torch
        import hyper_parallel as hp

        class Core(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.sinks = torch.nn.Parameter(torch.randn(HQ)) if options.get("sinks") else None

            def forward(self, q, k, v):
                return hp.attention(q, k, v, is_causal=options.get("causal", True),
                                    softcap=options.get("softcap"), sinks=self.sinks,
                                    window=options.get("window"))
        return Core()


def _inputs(seed):
    import torch
    g = torch.Generator().manual_seed(seed)
    shapes = [(B, HQ, S, D), (B, HKV, S, D), (B, HKV, S, D), (B, HQ, S, D)]
    return [torch.randn(s, generator=g) for s in shapes]


def check_case(mesh, mode, options, documents=False):
    """The CP block's output and gradients vs the reference (raises on a mismatch)."""
    import contextlib

    import torch
    from hyper_parallel import ContextParallel, attention_masks, get_platform, parallelize_module

    q, k, v, weight = _inputs(5)
    torch.manual_seed(3)
    core = _Core(options)
    torch.manual_seed(3)
    ref_core = _Core(options)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ids = _documents() if documents else None
    kwargs = {n: options.get(n) for n in ("softcap", "window")}
    ref = reference(*full, causal=options.get("causal", True), sinks=ref_core.sinks, documents=ids, **kwargs)
    (ref * weight).sum().backward()
    n, r = mesh.size(), mesh.get_local_rank()
    core = parallelize_module(core, mesh, ContextParallel(seq_dim=2, head_dim=1, **MODES[mode]))
    mine = [t.chunk(n, 2)[r].clone().requires_grad_() for t in (q, k, v)]
    context = attention_masks(document_ids=ids, block_size=3) if documents else contextlib.nullcontext()
    with context:
        out = core(*mine)
    (out * weight.chunk(n, 2)[r]).sum().backward()
    label = f"{mode} {options} documents={documents}"
    torch.testing.assert_close(out, ref.chunk(n, 2)[r], **TOL, msg=lambda m: f"{label} out: {m}")
    for name, got, want in zip("qkv", mine, full):
        torch.testing.assert_close(got.grad, want.grad.chunk(n, 2)[r], **TOL,
                                   msg=lambda m: f"{label} d{name}: {m}")
    if core.sinks is not None:
        total = get_platform().all_reduce(core.sinks.grad.clone(), mesh.get_group())
        torch.testing.assert_close(total, ref_core.sinks.grad, **TOL, msg=lambda m: f"{label} dsinks: {m}")


def _sweep(rank, world_size, cases):
    from hyper_parallel import init_device_mesh
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
    for mode, variant, documents in cases:
        check_case(mesh, mode, VARIANTS[variant] if isinstance(variant, str) else variant, documents)
    return len(cases)


CASES_2 = [(mode, variant, docs) for mode in ("ulysses", "allgather", "allgather_lb", "ring", "zigzag")
           for variant, docs in (("softcap", False), ("softcap_sinks", False), ("sinks", True),
                                 ("softcap", True))]
CASES_2 += [("ulysses", "softcap_bidirectional", False), ("ring", "softcap_bidirectional", False),
            ("ulysses_overlap", "softcap", False)]
CASES_4 = [(mode, "softcap_sinks", docs) for mode in ("hybrid", "hybrid_ring") for docs in (False, True)]
WINDOW_2 = [(mode, variant, docs) for mode in ("ulysses", "allgather", "allgather_lb", "ring", "zigzag")
            for variant, docs in (("window", False), ("window_all", True))]
WINDOW_4 = [(mode, variant, False) for mode in ("allgather", "ring", "zigzag", "hybrid", "hybrid_ring")
            for variant in ("window", "window_short")]
WINDOW_4 += [("zigzag", "window_all", True), ("hybrid", "window_all", True), ("ulysses", "window_short", False)]


@pytest.mark.parametrize("world_size,cases", [(2, CASES_2), (4, CASES_4)], ids=["cp2", "cp4"])
def test_softcap_and_sinks_every_mode(world_size, cases):
    assert run_dist(world_size, _sweep, cases, timeout=300) == [len(cases)] * world_size


@pytest.mark.parametrize("world_size,cases", [(2, WINDOW_2), (4, WINDOW_4)], ids=["cp2", "cp4"])
def test_sliding_window_every_mode(world_size, cases):
    assert run_dist(world_size, _sweep, cases, timeout=300) == [len(cases)] * world_size


def _sum_over_ranks(group):
    """Identity forward; backward sums the gradient over ``group`` (what data parallelism does for a
    parameter's gradient), so a global function of the sink logits has the single-device Jacobian."""
    import torch
    from hyper_parallel import get_platform

    class SumGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t.view_as(t)

        @staticmethod
        def backward(ctx, g):
            return get_platform().all_reduce(g.contiguous(), group)
    return SumGrad.apply


def _gradcheck(rank, world_size, cases):
    """``torch.autograd.gradcheck`` (fp64) of full q, k, v, sinks -> each rank's block -> CP -> the full
    output, for the soft-capped / sink paths of each mode (test_cp_gradcheck.py explains the pattern)."""
    import contextlib

    import torch
    import hyper_parallel as hp
    from hyper_parallel import (ContextParallel, DTensor, Replicate, Shard, attention_masks, init_device_mesh,
                                parallelize_module)

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
    for mode, options, documents in cases:
        class Core(torch.nn.Module):
            def forward(self, q, k, v, sinks):
                return hp.attention(q, k, v, is_causal=True, softcap=options.get("softcap"), sinks=sinks,
                                    window=options.get("window"))
        core = parallelize_module(Core(), mesh, ContextParallel(seq_dim=2, head_dim=1, **MODES[mode]))
        summed = _sum_over_ranks(mesh.get_group())

        def attention(q, k, v, sinks):
            blocks = [DTensor.from_local(t, mesh, [Replicate()]).redistribute(mesh, [Shard(2)]).to_local()
                      for t in (q, k, v)]
            ids = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2]])
            with attention_masks(document_ids=ids, block_size=3) if documents else contextlib.nullcontext():
                out = core(*blocks, summed(sinks))
            return DTensor.from_local(out, mesh, [Shard(2)]).full_tensor()

        g = torch.Generator().manual_seed(11)
        inputs = [torch.randn(shape, generator=g, dtype=torch.float64, requires_grad=True)
                  for shape in ((1, 2, 8, 2), (1, 1, 8, 2), (1, 1, 8, 2), (2,))]
        assert torch.autograd.gradcheck(attention, inputs, eps=1e-6, atol=1e-6, rtol=1e-5, fast_mode=True), \
            (mode, options, documents)
    return len(cases)


GRADCHECK = [("ulysses", {"softcap": 0.7}, False), ("allgather_lb", {"softcap": 0.7}, True),
             ("ring", {"softcap": 0.7}, False), ("zigzag", {"softcap": 0.7}, True),
             ("allgather", {}, True)]


def test_gradcheck_softcap_and_sinks():
    assert run_dist(2, _gradcheck, GRADCHECK, timeout=300) == [len(GRADCHECK)] * 2


def _window_bytes(rank, world_size, window):
    """Bytes this rank sends by kind in a second ring call (forward + backward)."""
    from hyper_parallel import CommDebugMode, ContextParallel, init_device_mesh, parallelize_module

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
    core = parallelize_module(_Core({"window": window}), mesh,
                              ContextParallel(seq_dim=2, head_dim=1, **MODES["ring"]))
    blocks = [t.chunk(world_size, 2)[rank].clone().requires_grad_() for t in _inputs(5)[:3]]
    core(*blocks).sum().backward()
    with CommDebugMode() as comm:
        core(*blocks).sum().backward()
    return comm.get_comm_bytes()


def test_ring_window_sends_only_the_blocks_it_needs():
    """A window of 2 on blocks of 4 (cp=4) reaches one block back: one K/V hop forward, one K/V hop
    and one dK/dV hop (straight home) backward, instead of 3 of each: bytes = 3 · 2 · B·Hkv·L·D·4."""
    block = B * HKV * (S // 4) * D * 4
    for got in run_dist(4, _window_bytes, 2):
        assert got["send_recv"] == 3 * 2 * block, got
    for got in run_dist(4, _window_bytes, None):
        assert got["send_recv"] == 3 * 3 * 2 * block, got


@pytest.mark.parametrize("framework,world", framework_worlds(2, mindspore=(2,)))
def test_variants_on_both_frameworks(framework, world):
    """tests/cases/cp_variants.py: softcap + sinks and window + sinks in the five 1-D modes, on
    torch and MindSpore."""
    from tests.cases import cp_variants
    done = run_on(framework, world, cp_variants.every_mode, timeout=900)
    assert all(len(r) == len(cp_variants.MODES) * len(cp_variants.OPTIONS) for r in done)
