"""The fused q/k/v all-to-all (core/context_parallel/movement/mode_moves.py) and the cached steady state
of a ContextParallel call.

* The fused move equals the per-tensor redistribution exactly (it only moves data): the same
  local blocks forward and the same input gradients backward, bit for bit, in BSHD and BNSD,
  batch 1 (results are views of the received buffer) and batch 2 (the reshape copies), equal and
  GQA head counts; and it runs one all-to-all forward and one backward (the per-tensor path three).
* End to end with batch 1 (the view path through the attention kernel), Ulysses and hybrid:
  output and dq, dk, dv equal single-device attention within 1e-5 in fp32.
* A steady-state call re-derives nothing: the mode's placements and the output's layout decision
  come from the per-signature caches (counted by wrapping the functions that derive them).
"""
import pytest

from tests.harness import run_dist

TOL = {"atol": 1e-5, "rtol": 1e-5}
LAYOUTS = {"bshd": (1, 2), "bnsd": (2, 1)}


def _shape(layout, B, S, H, D=4):
    return (B, S, H, D) if layout == "bshd" else (B, H, S, D)


def _moved(mesh, blocks, layout, fused):
    """q, k, v blocks moved sequence -> heads over the whole 1-D mesh (Ulysses): the results' local
    tensors, the input gradients of a weighted sum of them, and the collectives fwd / bwd."""
    import torch
    from hyper_parallel.core.comm_mode import CommDebugMode
    from hyper_parallel.core.context_parallel.movement import mode_dtensors
    from hyper_parallel.core.context_parallel.movement.mode_moves import input_placements, mode_placements
    from hyper_parallel.core.dtensor.dtensor import DTensor

    seq, head = LAYOUTS[layout]
    P = mesh.size()
    leaves = [t.clone().requires_grad_() for t in blocks]
    placements = [input_placements(mesh, t.ndim, seq, [0]) for t in leaves]
    shapes = []
    for t in leaves:
        shape = list(t.shape)
        shape[seq] *= P
        shapes.append(tuple(shape))
    with CommDebugMode() as fwd:
        if fused:
            out = mode_dtensors(mesh, leaves, placements, shapes, seq, head, [0], [])
        else:
            out = [DTensor.from_local(t, mesh, p, shape=s).redistribute(
                placements=mode_placements(p, mesh, t.ndim, seq, head, [0], [])[0])
                for t, p, s in zip(leaves, placements, shapes)]
    gen = torch.Generator().manual_seed(7 + mesh.get_rank())
    locals_ = [dt.to_local() for dt in out]
    loss = sum((t * torch.randn(t.shape, generator=gen)).sum() for t in locals_)
    with CommDebugMode() as bwd:
        loss.backward()
    # from_local's one-time cross-rank check (a new signature) is not part of the move
    counts = [{k: n for k, n in mode.get_comm_counts().items() if k != "shape_check"} for mode in (fwd, bwd)]
    return [t.detach().clone() for t in locals_], [t.grad for t in leaves], tuple(counts)


def _fused_equals_per_tensor_case(rank, world):
    import torch
    from hyper_parallel import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    n = 0
    for layout in LAYOUTS:
        for B in (1, 2):
            for Hq, Hkv in ((4, 4), (8, 4), (4, world)):
                gen = torch.Generator().manual_seed(100 * rank + n)
                blocks = [torch.randn(_shape(layout, B, 3, h), generator=gen) for h in (Hq, Hkv, Hkv)]
                fused = _moved(mesh, blocks, layout, fused=True)
                plain = _moved(mesh, blocks, layout, fused=False)
                where = f"{layout} B={B} Hq={Hq} Hkv={Hkv}"
                for a, b in zip(fused[0] + fused[1], plain[0] + plain[1]):
                    assert a.shape == b.shape and torch.equal(a, b), where
                assert fused[2] == ({"all_to_all": 1}, {"all_to_all": 1}), (where, fused[2])
                assert plain[2] == ({"all_to_all": 3}, {"all_to_all": 3}), (where, plain[2])
                n += 1
    return n


@pytest.mark.parametrize("world", [2, 4])
def test_fused_all_to_all_equals_per_tensor_redistribution(world):
    assert run_dist(world, _fused_equals_per_tensor_case, timeout=300) == [12] * world


def _attention(layout):
    import torch.nn as nn
    import torch.nn.functional as F

    class Attention(nn.Module):
        def forward(self, q, k, v):
            if layout == "bshd":
                q, k, v = (t.transpose(1, 2) for t in (q, k, v))
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
            return o.transpose(1, 2) if layout == "bshd" else o
    return Attention()


def _single_device(full, layout):
    import torch.nn.functional as F
    q, k, v = (t.transpose(1, 2) for t in full) if layout == "bshd" else full
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
    return out.transpose(1, 2) if layout == "bshd" else out


def _batch_one_case(rank, world):
    import torch
    from hyper_parallel import ContextParallel, init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    styles = [{}] + ([{"ulysses_degree": 2}] if world == 4 else [])
    n = 0
    for style in styles:
        for layout, (seq, head) in LAYOUTS.items():
            for Hq, Hkv in ((4, 4), (4, 2), (4, 1)):
                gen = torch.Generator().manual_seed(n)
                S = 4 * world
                full = [torch.randn(_shape(layout, 1, S, h), generator=gen).requires_grad_()
                        for h in (Hq, Hkv, Hkv)]
                w = torch.randn(_shape(layout, 1, S, Hq), generator=gen)
                want = _single_device(full, layout)
                (want * w).sum().backward()
                mine = [t.detach().chunk(world, seq)[rank].clone().requires_grad_() for t in full]
                attn = ContextParallel(seq_dim=seq, head_dim=head, **style).apply(_attention(layout), mesh)
                for _ in range(2):   # the first call of a signature and a steady-state one
                    for t in mine:
                        t.grad = None
                    out = attn(*mine)
                    (out * w.chunk(world, seq)[rank]).sum().backward()
                    got = [out] + [t.grad for t in mine]
                    expected = [want.detach()] + [t.grad for t in full]
                    for what, a, b in zip(("out", "dq", "dk", "dv"), got, expected):
                        torch.testing.assert_close(a, b.chunk(world, seq)[rank], **TOL,
                                                   msg=lambda m: f"{style} {layout} {Hq}/{Hkv} {what}: {m}")
                n += 1
    return n


@pytest.mark.parametrize("world", [2, 4])
def test_batch_one_matches_single_device(world):
    assert run_dist(world, _batch_one_case, timeout=300) == [6 * (1 + (world == 4))] * world


def _steady_state_case(rank, world):
    import torch
    from hyper_parallel import ContextParallel, init_device_mesh
    from hyper_parallel.core.context_parallel import output
    from hyper_parallel.core.context_parallel.movement import mode_moves

    mesh = init_device_mesh("cpu", (world,))
    calls = {"mode_placements": 0, "output_seq_dim": 0}
    derive = {"mode_placements": mode_moves.mode_placements, "output_seq_dim": output.output_seq_dim}

    def counted(name):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return derive[name](*args, **kwargs)
        return wrapper
    mode_moves._MOVES.clear()   # a worker may have run this signature in another case
    output._DECISIONS.clear()
    mode_moves.mode_placements = counted("mode_placements")
    output.output_seq_dim = counted("output_seq_dim")
    try:
        attn = ContextParallel(seq_dim=1, head_dim=2).apply(_attention("bshd"), mesh)
        q, k, v = (torch.randn(1, 4, 4, 4, requires_grad=True) for _ in range(3))
        attn(q, k, v).sum().backward()
        first = dict(calls)
        attn(q, k, v).sum().backward()
        attn(q.detach(), k.detach(), v.detach())   # no grad: same signature, same decisions
        later = {name: calls[name] - first[name] for name in calls}
    finally:
        mode_moves.mode_placements = derive["mode_placements"]
        output.output_seq_dim = derive["output_seq_dim"]
    return first, later


def test_steady_state_derives_nothing():
    results = run_dist(2, _steady_state_case, timeout=300)
    for first, later in results:
        assert first["mode_placements"] > 0 and first["output_seq_dim"] == 1, first
        assert later == {"mode_placements": 0, "output_seq_dim": 0}, later


def _raw_forms_case(rank, world):
    """benchmarks.cp_modes: the hand-packed one-all-to-all Ulysses equals the per-tensor one."""
    import torch
    from benchmarks.cp_frameworks import framework_ops
    from benchmarks.cp_modes import RAW, RAW_FUSED
    from hyper_parallel import init_device_mesh
    from hyper_parallel.platform import get_platform

    class Config:
        batch, seq, head_dim, causal = 1, 8 * world, 4, True

    mesh = init_device_mesh("cpu", (world,))
    fw = framework_ops(get_platform(), "float32")
    for heads, kv_heads in ((4, 4), (4, 2)):
        cfg = Config()
        cfg.heads, cfg.kv_heads = heads, kv_heads
        gen = torch.Generator().manual_seed(rank)
        blocks = [torch.randn(1, 8, h, 4, generator=gen) for h in (heads, kv_heads, kv_heads)]
        grad = torch.randn(1, 8, heads, 4, generator=gen)
        results = []
        for make in (RAW["ulysses"], RAW_FUSED["ulysses"]):
            leaves = [t.clone().requires_grad_() for t in blocks]
            out = make(cfg, mesh, fw)(*leaves)
            out.backward(grad)
            results.append([out.detach()] + [t.grad for t in leaves])
        for a, b in zip(*results):
            torch.testing.assert_close(a, b, **TOL)
    return True


def test_raw_fused_ulysses_equals_raw_ulysses():
    assert run_dist(2, _raw_forms_case, timeout=300) == [True, True]
