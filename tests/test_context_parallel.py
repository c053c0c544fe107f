"""ContextParallel (SPEC §6): Ulysses, all-gather KV, hybrid, head-tail load balancing, TP×CP.

Every rank builds the full q, k, v (or hidden states and projection weights) from one seed,
computes single-process attention on the full sequence as the reference, and runs its own
contiguous block through the ContextParallel module. Forward outputs and the gradients of q, k, v
(and of Linear projection weights) must match within 1e-5 (fp32). Communication is counted with
CommDebugMode and compared with SPEC §8's closed forms. Checks are grouped into few ``run_dist``
calls (each a round trip to the worker pool; 8 ranks on 2 cores are slow).

The mode × layout × kernel grid, explicit masks, GQA, Linear projections (weight gradients),
DTensor I/O and the argument errors are platform-neutral (tests/cases/context_parallel.py) and run
on torch and on MindSpore; the rest (window masks, load-balance work, recursion, call forms,
communication volume, named meshes) is torch only.
"""
import pytest

from tests.cases import context_parallel as neutral
from tests.harness import run_dist
from tests.harness.frameworks import framework_worlds, run_on

B, D = 2, 8                  # batch, head dim
TOL = {"atol": 1e-5, "rtol": 1e-5}
LAYOUTS = {"bshd": (1, 2), "bnsd": (2, 1)}   # layout -> (seq_dim, head_dim)
UL, AG, LB = {"ulysses_degree": None}, {"ulysses_degree": 1}, {"ulysses_degree": 1, "load_balance": True}


# ============================================================================ attention modules
def _attention_module(kind="sdpa", layout="bshd"):
    """A core-attention module ``forward(q, k, v, mask=None, causal=False, depth=0, boom=False)``:
    the neutral cases' attention (tests/frameworks/torch_adapter.py: SDPA or matmul/softmax with
    the causal mask built from the global lengths, GQA) plus what the torch-only checks need.
    ``depth`` > 0 calls the module itself first (recursion) and attends with its output as the
    queries; ``boom`` raises inside forward, after the inputs were distributed. ``seen`` records
    the q each call got."""
    import torch.nn as nn
    from tests.frameworks.torch_adapter import TorchAdapter

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.core = TorchAdapter.attention(kind, layout)
            self.seen = []

        def forward(self, q, k, v, mask=None, causal=False, depth=0, boom=False):
            if depth:
                q = self(q, k, v, mask=mask, causal=causal, depth=depth - 1)
            if boom:
                raise RuntimeError("boom")
            if hasattr(q, "placements"):
                self.seen.append((tuple(q.placements), q.to_local().detach().clone()))
            return self.core(q, k, v, mask=mask, causal=causal)

    return Attention()


def _kw_attention_module():
    """Takes q, k, v by keyword only (BSHD, sdpa)."""
    import torch.nn as nn
    import torch.nn.functional as F

    class KwAttention(nn.Module):
        def forward(self, *, q, k, v, causal=False):
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal).transpose(1, 2)

    return KwAttention()


# ============================================================================ helpers
def _mask(kind_of_mask, S, seed=7):
    """A global (S, S) bool mask (True = may attend)."""
    import torch
    if kind_of_mask is None:
        return None
    if kind_of_mask == "random":
        m = torch.rand(S, S, generator=torch.Generator().manual_seed(seed)) < 0.6
        return m | torch.eye(S, dtype=torch.bool)  # every row sees at least one key
    if kind_of_mask == "window":  # causal sliding window of 5
        i = torch.arange(S)
        return (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - 5)
    raise ValueError(kind_of_mask)


def _shape(layout, S, H):
    return (B, S, H, D) if layout == "bshd" else (B, H, S, D)


def _block(t, dim, index, parts):
    return t.chunk(parts, dim)[index]


def _leaf(t):
    return t.detach().clone().requires_grad_(True)


def _sum_over_ranks(t, group=None):
    import torch.distributed as dist
    t = t.clone()
    dist.all_reduce(t, group=group)
    return t


def _cp_mesh(world):
    from hyper_parallel import init_device_mesh
    return init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))


def _close(got, expected, what):
    import torch
    torch.testing.assert_close(got, expected, **TOL, msg=lambda m: f"{what}: {m}")


def _qkv(layout, S, H, seed=0, Hkv=None):
    """Full q, k, v and the output weight w (loss = sum(out * w)), equal on every rank."""
    import torch
    gen = torch.Generator().manual_seed(seed)
    shapes = [_shape(layout, S, H), _shape(layout, S, Hkv or H), _shape(layout, S, Hkv or H)]
    q, k, v = (torch.randn(s, generator=gen) for s in shapes)
    return q, k, v, torch.randn(shapes[0], generator=gen)


def _check(rank, world, mesh, style_kwargs, layout="bshd", kind="sdpa", causal=True, H=8, S=16,
           mask_kind=None, Hkv=None, depth=0, index=None, parts=None):
    """One ContextParallel attention call on this rank's block vs the full-sequence reference:
    output and dq, dk, dv. ``index``/``parts``: this rank's block (default rank/world)."""
    from hyper_parallel import ContextParallel

    index = rank if index is None else index
    parts = world if parts is None else parts
    seq, head = LAYOUTS[layout]
    full_q, full_k, full_v, w = _qkv(layout, S, H, Hkv=Hkv)
    mask = _mask(mask_kind, S)
    ref_leaves = [_leaf(t) for t in (full_q, full_k, full_v)]
    ref = _attention_module(kind, layout)(*ref_leaves, mask=mask, causal=causal, depth=depth)
    (ref * w).sum().backward()

    leaves = [_leaf(_block(t, seq, index, parts)) for t in (full_q, full_k, full_v)]
    module = ContextParallel(seq_dim=seq, head_dim=head, **style_kwargs).apply(
        _attention_module(kind, layout), mesh)
    out = module(*leaves, mask=mask, causal=causal, depth=depth)
    where = f"{style_kwargs} {layout} {kind} causal={causal} mask={mask_kind} Hkv={Hkv} depth={depth}"
    assert not hasattr(out, "placements"), f"local in -> local out, got {type(out).__name__} ({where})"
    _close(out, _block(ref, seq, index, parts), f"out {where}")
    (out * _block(w, seq, index, parts)).sum().backward()
    for name, leaf, ref_leaf in zip("qkv", leaves, ref_leaves):
        _close(leaf.grad, _block(ref_leaf.grad, seq, index, parts), f"d{name} {where}")
    return out.detach(), [leaf.grad for leaf in leaves]


# ============================================================================ modes × layouts × kernels
def _covering(modes):
    """Each mode on three grid points that, together, give it both layouts, both kernels and both
    causal flags; every grid point runs in some mode."""
    points = [[("bshd", "sdpa", True), ("bnsd", "matmul", False), ("bshd", "matmul", True)],
              [("bnsd", "sdpa", True), ("bshd", "matmul", False), ("bshd", "sdpa", False)],
              [("bshd", "sdpa", False), ("bnsd", "matmul", True), ("bnsd", "sdpa", True)],
              [("bnsd", "sdpa", False), ("bshd", "matmul", True), ("bnsd", "matmul", False)]]
    return [(mode, points[i % len(points)]) for i, mode in enumerate(modes)]


def _plan(framework, world):
    """World 2 and 4: every mode on the whole grid (hybrid 2×2 on 4); MindSpore on 4 ranks and
    world 8 (hybrid 4×2 and 2×4): every mode on a covering part of it."""
    if world == 2:
        return [(mode, neutral.GRID) for mode in (UL, AG, LB)]
    if world == 4:
        modes = (UL, AG, {"ulysses_degree": 2}, LB)
        return _covering(modes) if framework == "mindspore" else [(mode, neutral.GRID) for mode in modes]
    return _covering((UL, AG, {"ulysses_degree": 2}, {"ulysses_degree": 4}, LB))


@pytest.mark.parametrize("framework,world", framework_worlds(2, 4, 8))
def test_modes_layouts_kernels(framework, world):
    """Every mode × {causal, non-causal} × {BSHD, BNSD} × {SDPA, matmul/softmax} (see _plan). The
    same cases (tests/cases/context_parallel.py) on torch modules and MindSpore Cells."""
    S = 32 if world == 8 else 16
    plan = _plan(framework, world)
    done = run_on(framework, world, neutral.cp_grid, plan, S, timeout=280)
    assert [len(d) for d in done] == [sum(len(g) for _, g in plan)] * world


def _extra_modes(framework, world):
    """All modes; MindSpore on 4 ranks (slow on 2 cores): hybrid, which 2 ranks cannot run, and
    all-gather KV, the mode that slices explicit masks."""
    if framework == "mindspore" and world == 4:
        return [AG, {"ulysses_degree": 2}]
    return neutral.modes_for(world)


@pytest.mark.parametrize("framework,world", framework_worlds(2, 4))
def test_masks_dtensor_io_and_errors(framework, world):
    """Explicit global masks and GQA in every mode, DTensor in -> DTensor out, errors before any
    collective."""
    modes = _extra_modes(framework, world)
    done = run_on(framework, world, neutral.cp_extras, modes, timeout=280)
    assert [len(d) for d in done] == [4 * len(modes)] * world


@pytest.mark.parametrize("framework,world", framework_worlds(2, 4))
def test_projected_qkv_weight_gradients(framework, world):
    """q, k, v from Linear layers (torch nn.Linear, MindSpore mint.nn.Linear) on each rank's block
    of hidden states: output, dx, and the projections' weight/bias gradients in every mode."""
    modes = _extra_modes(framework, world)
    done = run_on(framework, world, neutral.cp_projected, modes, timeout=280)
    assert [len(d) for d in done] == [2 * len(modes)] * world


# ============================================================================ masks, projections, GQA
def _window_mask_case(rank, world):
    """A causal sliding-window mask given explicitly, through SDPA and matmul/softmax (random masks,
    projections and GQA run on both platforms: tests/cases/context_parallel.py)."""
    mesh = _cp_mesh(world)
    for mode in (UL, AG, {"ulysses_degree": 2}, LB):
        _check(rank, world, mesh, mode, "bnsd", "sdpa", False, mask_kind="window")
        _check(rank, world, mesh, mode, "bshd", "matmul", False, mask_kind="window")
    return True


def test_window_masks():
    assert run_dist(4, _window_mask_case, timeout=900) == [True] * 4


# ============================================================================ load balancing
def _load_balance_case(rank, world):
    """Load-balanced == unbalanced (outputs and grads); each rank computes chunks 2r and
    2cp-1-2r, so the causal work (chunk blocks under the diagonal) is 2cp+1 on every rank."""
    import torch
    from hyper_parallel import ContextParallel
    from hyper_parallel.core.dtensor.placement_types import HeadTailShard

    mesh = _cp_mesh(world)
    S, H, seq = 8 * world, 4, 1
    for layout, kind in (("bshd", "sdpa"), ("bnsd", "matmul")):
        out_lb, grads_lb = _check(rank, world, mesh, LB, layout, kind, True, H=H, S=S)
        out_ag, grads_ag = _check(rank, world, mesh, AG, layout, kind, True, H=H, S=S)
        _close(out_lb, out_ag, f"load-balanced vs unbalanced output {layout} {kind}")
        for a, b in zip(grads_lb, grads_ag):
            _close(a, b, f"load-balanced vs unbalanced grads {layout} {kind}")

    # what each rank actually computes: the q rows handed to the attention module
    full_q, full_k, full_v, _ = _qkv("bshd", S, H)
    inner = _attention_module("sdpa", "bshd")
    module = ContextParallel(ulysses_degree=1, load_balance=True).apply(inner, mesh)
    module(*(_block(t, seq, rank, world) for t in (full_q, full_k, full_v)), causal=True)
    chunks = full_q.chunk(2 * world, seq)
    computed = []
    assert len(inner.seen) == 2, inner.seen
    for half, (placements, local_q) in enumerate(inner.seen):
        assert placements == (HeadTailShard(seq, half),), placements
        chunk, total = placements[0].chunk_of(rank, world)
        assert total == 2 * world
        assert chunk == (2 * rank if half == 0 else 2 * world - 1 - 2 * rank)
        torch.testing.assert_close(local_q, chunks[chunk], rtol=0, atol=0)
        computed.append(chunk)
    return computed


@pytest.mark.parametrize("world", [2, 4, 8])
def test_load_balance_matches_unbalanced_and_balances_work(world):
    computed = run_dist(world, _load_balance_case, timeout=900)
    n_chunks = 2 * world
    # every chunk is computed exactly once
    assert sorted(c for pair in computed for c in pair) == list(range(n_chunks))
    # causal work of chunk c (query chunk c sees key chunks 0..c): c + 1 chunk blocks
    work = [sum(c + 1 for c in pair) for pair in computed]
    assert work == [n_chunks + 1] * world, work
    unbalanced = [(2 * r + 1) + (2 * r + 2) for r in range(world)]
    assert max(work) - min(work) == 0 < max(unbalanced) - min(unbalanced)


# ============================================================================ call forms, output policy
def _call_forms_case(rank, world):
    import torch
    from hyper_parallel import ContextParallel, DTensor, Shard

    mesh = _cp_mesh(world)
    S, H, seq = 16, 4, 1
    full_q, full_k, full_v, w = _qkv("bshd", S, H)
    ref_leaves = [_leaf(t) for t in (full_q, full_k, full_v)]
    ref = _attention_module()(*ref_leaves, causal=True)
    (ref * w).sum().backward()

    def expect(out, leaves, what):
        _close(out, _block(ref, seq, rank, world), f"out {what}")
        for name, leaf, ref_leaf in zip("qkv", leaves, ref_leaves):
            _close(leaf.grad, _block(ref_leaf.grad, seq, rank, world), f"d{name} {what}")

    def local_leaves():
        return [_leaf(_block(t, seq, rank, world)) for t in (full_q, full_k, full_v)]

    for mode in (UL, AG, LB):
        # q, k, v by keyword
        leaves = local_leaves()
        module = ContextParallel(qkv_kwarg_names=("q", "k", "v"), **mode).apply(_kw_attention_module(), mesh)
        out = module(q=leaves[0], k=leaves[1], v=leaves[2], causal=True)
        (out * _block(w, seq, rank, world)).sum().backward()
        expect(out, leaves, f"keywords {mode}")

        # a CP DTensor in (Shard(seq) on the CP mesh) -> a CP DTensor out
        leaves = local_leaves()
        module = ContextParallel(**mode).apply(_attention_module(), mesh)
        dts = [DTensor.from_local(t, mesh, [Shard(seq)]) for t in leaves]
        out = module(*dts, causal=True)
        assert isinstance(out, DTensor), type(out)
        assert out.device_mesh == mesh and tuple(out.placements) == (Shard(seq),), out.placements
        assert tuple(out.shape) == tuple(ref.shape)
        (out.to_local() * _block(w, seq, rank, world)).sum().backward()
        expect(out.to_local(), leaves, f"CP DTensor in {mode}")

        # use_local_output=True: a CP DTensor in -> a local tensor out
        leaves = local_leaves()
        module = ContextParallel(use_local_output=True, **mode).apply(_attention_module(), mesh)
        out = module(*[DTensor.from_local(t, mesh, [Shard(seq)]) for t in leaves], causal=True)
        assert not isinstance(out, DTensor), type(out)
        (out * _block(w, seq, rank, world)).sum().backward()
        expect(out, leaves, f"use_local_output {mode}")

        # re-entrancy: one module shared by two layers, and a module that calls itself
        for depth, shared in ((0, True), (1, False), (2, True)):
            ref_leaves2 = [_leaf(t) for t in (full_q, full_k, full_v)]
            plain = _attention_module()
            ref2 = plain(plain(*ref_leaves2, causal=True, depth=depth), *ref_leaves2[1:], causal=True,
                         depth=depth) if shared else plain(*ref_leaves2, causal=True, depth=depth)
            (ref2 * w).sum().backward()
            leaves = local_leaves()
            module = ContextParallel(**mode).apply(_attention_module(), mesh)
            out = module(*leaves, causal=True, depth=depth)
            if shared:
                out = module(out, *leaves[1:], causal=True, depth=depth)
            (out * _block(w, seq, rank, world)).sum().backward()
            what = f"re-entrant depth={depth} shared={shared} {mode}"
            _close(out, _block(ref2, seq, rank, world), f"out {what}")
            for name, leaf, ref_leaf in zip("qkv", leaves, ref_leaves2):
                _close(leaf.grad, _block(ref_leaf.grad, seq, rank, world), f"d{name} {what}")

        # exception safety: a forward that raises leaves the module usable
        module = ContextParallel(**mode).apply(_attention_module(), mesh)
        for _ in range(2):
            try:
                module(*local_leaves(), causal=True, boom=True)
            except RuntimeError as exc:
                assert "boom" in str(exc)
            else:
                raise AssertionError("forward should have raised")
        leaves = local_leaves()
        out = module(*leaves, causal=True)
        (out * _block(w, seq, rank, world)).sum().backward()
        expect(out, leaves, f"after a raising forward {mode}")
        torch.distributed.barrier()
    return True


def test_call_forms_output_policy_reentrancy_exceptions():
    assert run_dist(2, _call_forms_case, timeout=600) == [True] * 2


# ============================================================================ hybrid on other meshes
def _hybrid_meshes_case(rank, world):
    """Hybrid on a 2-D mesh named ("co", "ds") and on a "cp" slice of a ("dp", "cp") root mesh."""
    from hyper_parallel import init_device_mesh

    if world == 4:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("co", "ds"))
        for kind in ("sdpa", "matmul"):
            _check(rank, world, mesh, UL, "bshd", kind, True)
            _check(rank, world, mesh, {"ulysses_degree": 2}, "bnsd", kind, False)
    else:  # 8 = dp 2 × cp 4; each dp replica runs CP over its 4 ranks
        root = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "cp"))
        cp = root["cp"]
        index = cp.get_local_rank()
        for mode in ({"ulysses_degree": 2}, UL, LB):
            _check(rank, world, cp, mode, "bshd", "sdpa", True, index=index, parts=4)
        _check(rank, world, cp, {"ulysses_degree": 2}, "bnsd", "matmul", True, index=index, parts=4)
    return True


@pytest.mark.parametrize("world", [4, 8])
def test_hybrid_named_and_sliced_meshes(world):
    assert run_dist(world, _hybrid_meshes_case, timeout=900) == [True] * world


# ============================================================================ TP × CP
def _spec_elements(mode, P, S, Hq, Hkv):
    """SPEC §8: elements one rank sends in one forward, per collective kind."""
    if mode == "ulysses":
        return {"all_to_all": (P - 1) * B * (S // P) * D * (2 * Hq + 2 * Hkv) // P}
    if mode == "allgather":
        return {"all_gather": 2 * (P - 1) * B * S * Hkv * D // P}
    if mode == "load_balance":
        return {"all_gather": 2 * (P - 1) * B * S * Hkv * D // P,
                "send_recv": 2 * B * (S // (2 * P)) * Hq * D}
    u, r = mode
    return {"all_to_all": (u - 1) * B * (S // P) * D * (2 * Hq + 2 * Hkv) // u,
            "all_gather": 2 * (r - 1) * B * S * Hkv * D // (r * u)}


# backward moves the same again; the names of the backward collectives
_BACKWARD_NAME = {"all_to_all": "all_to_all", "all_gather": "reduce_scatter", "send_recv": "send_recv"}


def _comm_case(rank, world, S, Hq, Hkv, layout, kind):
    import torch
    from hyper_parallel import CommDebugMode, ContextParallel

    mesh = _cp_mesh(world)
    modes = [("ulysses", UL), ("allgather", AG), ("load_balance", LB)]
    if world == 4:
        modes.append(((2, 2), {"ulysses_degree": 2}))
    if world == 8:
        modes += [((2, 4), {"ulysses_degree": 2}), ((4, 2), {"ulysses_degree": 4})]
    seq, head = LAYOUTS[layout]
    full_q, full_k, full_v, _ = _qkv(layout, S, Hq, Hkv=Hkv)
    report = {}
    for name, style_kwargs in modes:
        leaves = [_leaf(_block(t, seq, rank, world)) for t in (full_q, full_k, full_v)]
        module = ContextParallel(seq_dim=seq, head_dim=head, **style_kwargs).apply(
            _attention_module(kind, layout), mesh)
        with CommDebugMode() as fwd:
            out = module(*leaves, causal=True)
        with CommDebugMode() as bwd:
            out.sum().backward()
        got_f = {op: n for op, n in fwd.get_comm_bytes().items() if op != "shape_check"}
        got_b = {op: n for op, n in bwd.get_comm_bytes().items() if op != "shape_check"}
        want_f = {op: 4 * n for op, n in _spec_elements(name, world, S, Hq, Hkv).items()}
        want_b = {_BACKWARD_NAME[op]: n for op, n in want_f.items()}
        assert got_f == want_f, f"{name} forward bytes {got_f} != SPEC §8 {want_f}\n{fwd.summary()}"
        assert got_b == want_b, f"{name} backward bytes {got_b} != SPEC §8 {want_b}\n{bwd.summary()}"
        report[str(name)] = (got_f, got_b)
        torch.distributed.barrier()
    return report


@pytest.mark.parametrize("world,Hkv,layout,kind", [(2, 4, "bshd", "sdpa"), (4, 8, "bshd", "sdpa"),
                                                   (4, 4, "bnsd", "sdpa"), (4, 8, "bshd", "matmul"),
                                                   (8, 8, "bshd", "sdpa")])
def test_communication_volume_matches_spec(world, Hkv, layout, kind):
    """Bytes per collective, forward and backward, equal SPEC §8 (fp32: 4 bytes per element) for
    every mode; Hkv < Hq is GQA."""
    report = run_dist(world, _comm_case, 32, 8, Hkv, layout, kind, timeout=600)
    assert all(r == report[0] for r in report)  # every rank sends the same


# ============================================================================ errors
def _expect_value_error(fn, *words):
    try:
        fn()
    except ValueError as exc:
        for word in words:
            assert word in str(exc), f"{word!r} not in {exc}"
        return str(exc)
    raise AssertionError(f"no ValueError (wanted one mentioning {words})")


def _errors_case(rank, world):
    """Every error is a ValueError raised on every rank before any data moves (at most the tiny
    "shape_check" all-reduce runs), and the ranks stay in step afterwards."""
    import torch
    from hyper_parallel import CommDebugMode, ContextParallel

    mesh = _cp_mesh(world)
    full_q, full_k, full_v, _ = _qkv("bshd", 16, 4)
    q, k, v = (_block(t, 1, rank, world) for t in (full_q, full_k, full_v))

    def cp(**kwargs):
        return ContextParallel(**kwargs).apply(_attention_module(), mesh)

    def no_data_moved(fn, *words):
        with CommDebugMode() as comm:
            message = _expect_value_error(fn, *words)
        assert set(comm.get_comm_counts()) <= {"shape_check"}, (message, comm.summary())
        return message

    # heads not divisible by the Ulysses degree (4 ranks, 6 heads; and 2 ∤ 3 heads for ds=2)
    q6, k6, v6 = (torch.randn(B, 4, 6, D) for _ in range(3))
    no_data_moved(lambda: cp()(q6, k6, v6, causal=True), "heads", "ulysses_degree")
    q3, k3, v3 = (torch.randn(B, 4, 3, D) for _ in range(3))
    no_data_moved(lambda: cp(ulysses_degree=2)(q3, k3, v3), "heads")
    # cp not divisible by ulysses_degree
    no_data_moved(lambda: cp(ulysses_degree=3), "ulysses_degree=3", "divide")
    # local sequence lengths that differ across ranks: rank 0 passes a longer block
    longer = 5 if rank == 0 else 4
    ql, kl, vl = (torch.randn(B, longer, 4, D) for _ in range(3))
    for mode in (UL, AG, LB):
        no_data_moved(lambda: cp(**mode)(ql, kl, vl, causal=True), "different shapes")
    # q/k/v missing
    no_data_moved(lambda: cp()(q, k), "v is missing")
    no_data_moved(lambda: ContextParallel(qkv_kwarg_names=("q", "k", "v")).apply(
        _kw_attention_module(), mesh)(q=q, k=k), "v is missing")
    # an odd local length with load balancing
    qo, ko, vo = (torch.randn(B, 3, 4, D) for _ in range(3))
    no_data_moved(lambda: cp(**LB)(qo, ko, vo, causal=True), "odd")
    # the ranks are still in step: a correct call works
    _check(rank, world, mesh, UL, H=4, S=16)
    _check(rank, world, mesh, LB, H=4, S=16)
    return True


def test_errors_raise_on_every_rank_before_data_moves():
    assert run_dist(4, _errors_case, timeout=300) == [True] * 4


def test_construction_errors():
    from hyper_parallel import ContextParallel
    for degree in (None, 2):
        with pytest.raises(ValueError, match="load_balance"):
            ContextParallel(ulysses_degree=degree, load_balance=True)
    with pytest.raises(ValueError, match="seq_dim"):
        ContextParallel(seq_dim=1, head_dim=1)
    with pytest.raises(ValueError, match="ulysses_degree"):
        ContextParallel(ulysses_degree=0)
    with pytest.raises(ValueError, match="kv_exchange"):
        ContextParallel(kv_exchange="bogus")
    ContextParallel(ulysses_degree=1, load_balance=True)  # fine
