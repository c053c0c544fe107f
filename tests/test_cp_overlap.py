"""ContextParallel overlap and memory (issue 17, items 1 and 6): q, k, v in one fused all-to-all,
k, v in one all-gather, the ring's backward dK/dV hop overlapped with block compute and sent in
the input dtype, and ring memory that stays flat in the ring size.

Every rank builds the full q, k, v from one seed and runs single-device attention as the reference
(GQA by repeat_interleave); its own block then runs through ContextParallel, and the output and
dq, dk, dv blocks must match within 1e-5 in fp32. Collective counts come from CommDebugMode;
memory from the platform's peak-memory tracker (live bytes of every storage created in the
region, in units of one K+V block), never from timing.
"""
import pytest

from tests.harness import run_dist

B, D = 2, 4
TOL = {"atol": 1e-5, "rtol": 1e-5}
LAYOUTS = {"bshd": (1, 2), "bnsd": (2, 1)}
MODES = {
    "ulysses": {},
    "allgather": {"ulysses_degree": 1},
    "allgather-lb": {"ulysses_degree": 1, "load_balance": True},
    "hybrid": {"ulysses_degree": 2},
    "ring": {"ulysses_degree": 1, "kv_exchange": "ring"},
    "ring-zigzag": {"ulysses_degree": 1, "load_balance": True, "kv_exchange": "ring"},
    "hybrid-ring": {"ulysses_degree": 2, "kv_exchange": "ring"},
}


def _shape(layout, S, H):
    return (B, S, H, D) if layout == "bshd" else (B, H, S, D)


def _module():
    import torch.nn as nn
    import torch.nn.functional as F

    class Attention(nn.Module):
        def __init__(self, layout):
            super().__init__()
            self.layout = layout

        def forward(self, q, k, v, causal=True):
            if self.layout == "bshd":
                q, k, v = (t.transpose(1, 2) for t in (q, k, v))
            gqa = q.shape[1] != k.shape[1]
            o = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
            return o.transpose(1, 2) if self.layout == "bshd" else o
    return Attention


def _reference(full, layout, causal):
    import torch.nn.functional as F
    q, k, v = full
    if layout == "bshd":
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    groups = q.shape[1] // k.shape[1]
    k, v = (x.repeat_interleave(groups, dim=1) for x in (k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return out.transpose(1, 2) if layout == "bshd" else out


def _run_mode(mesh, style, layout, causal, Hq, Hkv, S, dtype=None, seed=0):
    """(output, dq, dk, dv) of this rank's block, and of the reference, as (got, expected) pairs."""
    import torch
    from hyper_parallel import ContextParallel

    seq, head = LAYOUTS[layout]
    rank, P = mesh.get_rank(), mesh.size()
    gen = torch.Generator().manual_seed(seed)
    full = [torch.randn(_shape(layout, S, h), generator=gen) for h in (Hq, Hkv, Hkv)]
    if dtype is not None:   # half inputs: the reference is fp32 on the same rounded values
        full = [t.to(dtype).float() for t in full]
    w = torch.randn(_shape(layout, S, Hq), generator=gen)
    leaves = [t.clone().requires_grad_() for t in full]
    (_reference(leaves, layout, causal) * w).sum().backward()
    expected = _reference(full, layout, causal).chunk(P, seq)[rank]
    mine = [t.chunk(P, seq)[rank].clone().to(dtype or t.dtype).requires_grad_() for t in full]
    attn = ContextParallel(seq_dim=seq, head_dim=head, **style).apply(_module()(layout), mesh)
    out = attn(*mine, causal=causal)
    (out.float() * w.chunk(P, seq)[rank]).sum().backward()
    got = [out] + [t.grad for t in mine]
    want = [expected] + [leaf.grad.chunk(P, seq)[rank] for leaf in leaves]
    return list(zip(got, want))


def _every_mode_case(rank, world):
    """Every mode (hybrids from world 4), BSHD and BNSD, causal or not, equal and GQA heads."""
    import torch
    from hyper_parallel import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    n = 0
    for name, style in MODES.items():
        if name.startswith("hybrid") and world < 4:
            continue
        for layout in LAYOUTS:
            for causal in (True, False):
                for Hq, Hkv in ((4, 4), (4, 2)):
                    pairs = _run_mode(mesh, style, layout, causal, Hq, Hkv, S=4 * world)
                    for what, (got, want) in zip(("out", "dq", "dk", "dv"), pairs):
                        torch.testing.assert_close(got, want, **TOL, msg=lambda m: f"{name} {layout} causal="
                                                   f"{causal} Hq={Hq} Hkv={Hkv} {what}: {m}")
                    n += 1
    return n


@pytest.mark.parametrize("world", [2, 4])
def test_every_mode_matches_single_device(world):
    per_rank = 2 * 2 * 2 * (len(MODES) - (2 if world < 4 else 0))
    assert run_dist(world, _every_mode_case, timeout=600) == [per_rank] * world


def _count_case(rank, world):
    """Collectives of one Ulysses / all-gather / hybrid call, forward and backward apart."""
    from hyper_parallel import init_device_mesh
    from hyper_parallel.core.comm_mode import CommDebugMode
    import torch
    from hyper_parallel import ContextParallel

    mesh = init_device_mesh("cpu", (world,))
    counts = {}
    for name in ("ulysses", "allgather", "hybrid"):
        if name == "hybrid" and world < 4:
            continue
        q, k, v = (torch.randn(B, 8, 4, D, requires_grad=True) for _ in range(3))
        attn = ContextParallel(seq_dim=1, head_dim=2, **MODES[name]).apply(_module()("bshd"), mesh)
        attn(q, k, v)   # the first call of a signature also runs the shape check
        with CommDebugMode() as fwd:
            out = attn(q, k, v)
        with CommDebugMode() as bwd:
            out.sum().backward()
        counts[name] = ({op: c for op, c in fwd.get_comm_counts().items() if op != "shape_check"},
                        dict(bwd.get_comm_counts()))
    return counts


@pytest.mark.parametrize("world", [2, 4])
def test_qkv_travel_in_one_collective(world):
    """Ulysses: one all-to-all for q, k, v and one for the output (was four); backward the same.
    All-gather KV: one all-gather for k and v, one reduce-scatter back. Hybrid: both."""
    counts = run_dist(world, _count_case, timeout=300)[0]
    assert counts["ulysses"] == ({"all_to_all": 2}, {"all_to_all": 2}), counts["ulysses"]
    assert counts["allgather"] == ({"all_gather": 1}, {"reduce_scatter": 1}), counts["allgather"]
    if world >= 4:
        assert counts["hybrid"] == ({"all_to_all": 2, "all_gather": 1},
                                    {"all_to_all": 2, "reduce_scatter": 1}), counts["hybrid"]


def _bf16_case(rank, world):
    """bf16 through the ring (dK/dV hops in bf16): the largest error against fp32 single-device
    attention on the same rounded inputs, and single-device bf16 attention's own, for scale."""
    import torch
    from hyper_parallel import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    errors = {}
    for name in ("ring", "ring-zigzag"):
        pairs = _run_mode(mesh, MODES[name], "bnsd", True, 4, 4, S=64 * world, dtype=torch.bfloat16)
        errors[name] = max(float((g.detach().float() - w).abs().max()) for g, w in pairs)
    errors["single-device bf16"] = _single_bf16_error(rank, world)
    return errors


def _single_bf16_error(rank, world, S_per_rank=64):
    """Single-device bf16 SDPA's own largest error (output and grads) on the same kind of inputs."""
    import torch
    gen = torch.Generator().manual_seed(0)
    S = S_per_rank * world
    full = [torch.randn(_shape("bnsd", S, 4), generator=gen).to(torch.bfloat16).float() for _ in range(3)]
    w = torch.randn(_shape("bnsd", S, 4), generator=gen)
    results = []
    for dtype in (torch.float32, torch.bfloat16):
        leaves = [t.detach().clone().to(dtype).requires_grad_() for t in full]
        out = _reference(leaves, "bnsd", True)
        (out.float() * w).sum().backward()
        results.append([out.detach().float()] + [t.grad.float() for t in leaves])
    return max(float((a - b).abs().max()) for a, b in zip(*results))


def test_ring_bf16_hops_stay_within_tolerance():
    """The dK/dV accumulators travel in bf16 (one rounding per hop). Measured at P = 4 (S = 256,
    causal): ring 0.0257, zigzag 0.0179, single-device bf16 SDPA 0.0116 -- and the ring's 0.0257 is
    the same with the accumulators travelling in fp32, so the bf16 hop adds no visible error. Bound:
    the benchmark's bf16 tolerance 3e-2, and at most 3x single-device bf16's own error."""
    errors = run_dist(4, _bf16_case, timeout=300)
    worst = {name: max(e[name] for e in errors) for name in errors[0]}
    single = worst.pop("single-device bf16")
    assert all(e <= min(3e-2, 3 * single) for e in worst.values()), (worst, single)


def _memory_case(rank, world, L, H):
    """Peak live bytes of one ring fwd+bwd on local (1, H, L, D) blocks, in units of one K+V block,
    for rings of every size 1..world (ranks 0..P-1 ring, the rest ring alone)."""
    import torch
    from hyper_parallel.core.context_parallel.ring.ring_attention import RingLayout, ring_attention
    from hyper_parallel.platform import get_platform

    platform = get_platform()
    block = 2 * H * L * D * 4
    peaks = {}
    for P in range(1, world + 1):
        ranks = tuple(range(P)) if rank < P else (rank,)
        layout = RingLayout(ranks, ranks.index(rank))
        q, k, v = (torch.randn(1, H, L, D, requires_grad=True) for _ in range(3))
        g = torch.randn(1, H, L, D)
        with platform.track_peak_memory() as mem:
            ring_attention(q, k, v, layout, causal=True).backward(g)
        peaks[P] = mem.peak_bytes / block
        platform.barrier()
    with platform.track_peak_memory() as mem:   # single-device attention on the same local length
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).backward(g)
    peaks["single"] = mem.peak_bytes / block
    return peaks


def test_ring_memory_flat_in_ring_size():
    """A per-step buffer that outlived its step would add a block per extra step. From P = 4 on, a
    step holds the K/V block in use and the one arriving, and the dK/dV hop in flight (P = 2 and 3
    never have both at once, so they peak lower): the peak at P = 5 equals P = 4, and stays under
    10.5 K+V blocks (q's gradient, the own block's dK/dV, the two K/V blocks, the hop's send and
    receive buffers, the kernel's outputs and the accumulated sum)."""
    peaks = run_dist(5, _memory_case, 256, 2, timeout=300)
    for p in peaks[:4]:
        assert abs(p[5] - p[4]) < 0.01, p
        assert p[4] <= 10.5, p
        assert p[2] <= p[3] <= p[4], p
