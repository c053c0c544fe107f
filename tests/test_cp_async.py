"""ContextParallel(overlap=True) / AsyncContextParallel (SPEC §6 "Overlap"): head-chunk pipelining.

Every rank builds the full q, k, v from one seed and computes single-device attention on the full
sequence as the reference (k/v heads repeated with repeat_interleave for GQA); its own contiguous
block then runs through the overlapped module, and the output and dq, dk, dv blocks must match
within 1e-5 (fp32). ``observe_pipeline`` counts the chunks that really ran pipelined (0 where the
call is expected to run whole), and one test checks the order of collectives and attention
compute: chunk c+1's collective starts before chunk c's attention and is waited for after it, in
forward and in backward (no timing).
"""
import pytest

from tests.cases import context_parallel as neutral
from tests.cases import cp_overlap as overlap_cases
# the single-device reference and block helpers are the GQA/mesh tests' (one copy)
from tests.test_cp_gqa_and_meshes import (LAYOUTS, POINTS, TOL, _block_index, _leaf, _problem, _reference,
                                          _shape)
from tests.harness import run_dist
from tests.harness.frameworks import framework_worlds, run_on


def _check(mesh, style, layout, kind, causal, Hq, Hkv, chunks_expected, S=16, seed=0):
    """One overlapped call on this rank's block vs the reference; returns a description."""
    import torch
    from hyper_parallel import AsyncContextParallel
    from hyper_parallel.core.context_parallel.overlap.pipeline import observe_pipeline
    from tests.frameworks.torch_adapter import TorchAdapter

    seq, head = LAYOUTS[layout]
    full, w, ref_leaves, ref = _problem(layout, causal, Hq, Hkv, S, seed)

    index, parts = _block_index(mesh)
    leaves = [_leaf(t.chunk(parts, seq)[index]) for t in full]
    module = AsyncContextParallel(seq_dim=seq, head_dim=head, **style).apply(
        TorchAdapter.attention(kind, layout), mesh)
    with torch.no_grad():   # all-gather KV learns where the chunk outputs join from a whole call
        module(*leaves, causal=causal)
    seen = set()
    with observe_pipeline(lambda stage, chunk, event: seen.add(chunk)):
        out = module(*leaves, causal=causal)
        (out * w.chunk(parts, seq)[index]).sum().backward()
    where = f"{style} mesh={mesh.mesh_shape} {layout} {kind} causal={causal} Hq={Hq} Hkv={Hkv}"
    assert len(seen) == chunks_expected, f"{where}: {len(seen)} chunks pipelined, expected {chunks_expected}"
    torch.testing.assert_close(out, ref.chunk(parts, seq)[index], **TOL, msg=lambda m: f"out {where}: {m}")
    for name, leaf, ref_leaf in zip("qkv", leaves, ref_leaves):
        torch.testing.assert_close(leaf.grad, ref_leaf.grad.chunk(parts, seq)[index], **TOL,
                                   msg=lambda m, n=name: f"d{n} {where}: {m}")
    return where


def _cp_mesh(world):
    from hyper_parallel import init_device_mesh
    return init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))


def _grid_case(rank, world, plan, two_d=False):
    """``plan``: [(style kwargs, Hq, Hkv, chunks expected, points or None for all), ...]."""
    from hyper_parallel import init_device_mesh
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("co", "ds")) if two_d else _cp_mesh(world)
    return [_check(mesh, style, *point, Hq=hq, Hkv=hkv, chunks_expected=n)
            for style, hq, hkv, n, points in plan for point in (points or POINTS)]


UL, AG = {"ulysses_degree": None}, {"ulysses_degree": 1}
GQA_POINTS = [("bshd", "sdpa", True), ("bnsd", "matmul", False)]


def test_overlap_two_ranks():
    """Ulysses and all-gather KV on 2 ranks, every layout/kernel/causal point, 2 chunks pipelined;
    GQA with k/v heads divisible by 2·ds pipelined; heads one chunk cannot split over ds (Hq=2)
    and MQA below the degree (Hkv=1: replicated to 2 heads, not 2 chunks of 2) run whole."""
    plan = [(UL, 4, 4, 2, None), (AG, 4, 4, 2, None),
            (UL, 8, 4, 2, GQA_POINTS), (AG, 8, 2, 2, GQA_POINTS),
            (UL, 2, 2, 0, GQA_POINTS), (UL, 4, 1, 0, GQA_POINTS), (AG, 4, 1, 0, GQA_POINTS)]
    done = run_dist(2, _grid_case, plan, timeout=600)
    assert len(done[0]) == 2 * len(POINTS) + 5 * len(GQA_POINTS)


def test_overlap_four_ranks_hybrid_and_gqa():
    """World 4: hybrid (ulysses_degree=2: all-to-all then k/v all-gather, both split) with MHA and
    GQA, 3 chunks of Ulysses 4 with Hkv=3 < ds (replicated to 12 k/v heads, 4 per chunk), and
    Ulysses with 4 chunks."""
    plan = [({"ulysses_degree": 2}, 8, 8, 2, GQA_POINTS), ({"ulysses_degree": 2}, 8, 4, 2, GQA_POINTS),
            ({"chunks": 3}, 12, 3, 3, GQA_POINTS), ({"chunks": 4}, 16, 16, 4, [("bnsd", "sdpa", True)])]
    done = run_dist(4, _grid_case, plan, timeout=600)
    assert len(done[0]) == 7


def test_overlap_hybrid_2d_mesh():
    done = run_dist(4, _grid_case, [({}, 8, 8, 2, GQA_POINTS)], two_d=True, timeout=600)
    assert len(done[0]) == 2


# ============================================================================ the pipeline's order
def _order_case(rank, world, layout):
    """Ulysses, 2 chunks: the log of collective events (observe_pipeline) and attention compute
    (tensor hooks in the module: forward call, backward start at the output, end at q's first op)."""
    import torch
    from hyper_parallel import AsyncContextParallel
    from hyper_parallel.core.context_parallel.overlap.pipeline import observe_pipeline
    from tests.frameworks.torch_adapter import TorchAdapter

    log, calls = [], []
    inner = TorchAdapter.attention("sdpa", layout)

    class Logged(torch.nn.Module):
        def forward(self, q, k, v, causal=False):
            c = len(calls)
            calls.append(c)
            log.append(("attn", c, "forward"))
            q = q * 1.0   # its gradient is the last of this attention's backward (q's own comes later)
            q.register_hook(lambda g: log.append(("attn", c, "backward_end")))
            out = inner(q, k, v, causal=causal)
            out.register_hook(lambda g: log.append(("attn", c, "backward_begin")))
            return out

    seq, head = LAYOUTS[layout]
    qkv = [torch.randn(_shape(layout, 8, 4)).requires_grad_(True) for _ in range(3)]
    module = AsyncContextParallel(seq_dim=seq, head_dim=head).apply(Logged(), _cp_mesh(world))
    with observe_pipeline(lambda stage, chunk, event: log.append((stage, chunk, event))):
        out = module(*qkv, causal=True)
        forward_log = list(log)
        out.sum().backward()
    at = {entry: i for i, entry in enumerate(log)}
    # forward: chunk 1's q/k/v travel during chunk 0's attention, chunk 0's output during chunk 1's
    assert at[("in", 1, "start")] < at[("attn", 0, "forward")] < at[("in", 1, "wait")], forward_log
    assert at[("out", 0, "start")] < at[("attn", 1, "forward")] < at[("out", 0, "wait")], forward_log
    # backward: chunk 1's input-gradient all-to-all travels during chunk 0's attention backward,
    # chunk 0's output-gradient all-to-all during chunk 1's
    assert at[("in", 1, "grad_start")] < at[("attn", 0, "backward_begin")], log
    assert at[("attn", 0, "backward_end")] < at[("in", 1, "grad_wait")], log
    assert at[("out", 0, "grad_start")] < at[("attn", 1, "backward_begin")], log
    assert at[("attn", 1, "backward_end")] < at[("out", 0, "grad_wait")], log
    return len(calls)


@pytest.mark.parametrize("layout", ["bshd", "bnsd"])
def test_pipeline_overlaps_forward_and_backward(layout):
    assert run_dist(2, _order_case, layout) == [2, 2]


def _count_case(rank, world, style, H, Hkv, expected):
    """Collectives of a steady-state call (after a first one ran the shape checks), forward and
    backward: one fused q/k/v all-to-all (one k/v all-gather) and one output all-to-all per chunk."""
    import os
    saved = os.environ.pop("HP_CP_DEBUG", None)  # the default mode (the suite runs in debug mode)
    try:
        return _count_steady(world, style, H, Hkv, expected)
    finally:
        if saved is not None:
            os.environ["HP_CP_DEBUG"] = saved


def _count_steady(world, style, H, Hkv, expected):
    import torch
    from hyper_parallel import AsyncContextParallel
    from hyper_parallel.platform import get_platform
    from tests.frameworks.torch_adapter import TorchAdapter
    mesh = _cp_mesh(world)
    module = AsyncContextParallel(seq_dim=1, head_dim=2, **style).apply(TorchAdapter.attention("sdpa"), mesh)
    qkv = [torch.randn(_shape("bshd", 8, h)).requires_grad_(True) for h in (H, Hkv, Hkv)]
    module(*qkv, causal=True).sum().backward()
    seen = []
    observer = lambda op, nbytes, ranks: seen.append(op)  # noqa: E731
    get_platform().add_comm_observer(observer)
    try:
        out = module(*qkv, causal=True)
        forward = sorted(seen)
        out.sum().backward()
    finally:
        get_platform().remove_comm_observer(observer)
    assert forward == sorted(expected), forward
    return sorted(seen[len(forward):])


@pytest.mark.parametrize("style,H,Hkv,forward,backward", [
    ({}, 8, 4, ["all_to_all"] * 4, ["all_to_all"] * 4),
    ({"ulysses_degree": 1}, 4, 2, ["all_gather"] * 2, ["reduce_scatter"] * 2),
], ids=["ulysses-gqa", "allgather-gqa"])
def test_steady_state_collectives(style, H, Hkv, forward, backward):
    """2 chunks: 2 collectives in, 2 out (Ulysses) or 2 in (all-gather KV), no shape-check
    all-reduce; backward mirrors them (gloo's reduce-scatter may be emulated by an all-to-all)."""
    done = run_dist(2, _count_case, style, H, Hkv, forward)
    for ops in done:
        assert len(ops) == len(backward) and set(ops) <= {backward[0], "all_to_all"}, ops


# ============================================================================ projections, errors
def test_overlap_with_projections():
    """q, k, v from Linear layers: dx and the projection weights' gradients (summed over ranks)
    equal one process, for Ulysses and all-gather KV (H=4 on 2 ranks: 2 chunks)."""
    modes = [{"overlap": True}, {"ulysses_degree": 1, "overlap": True}]
    done = run_dist(2, neutral.cp_projected, modes, timeout=600)
    assert len(done[0]) == 4


def _errors_case(rank, world):
    from hyper_parallel import AsyncContextParallel, ContextParallel
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="chunks="):
            AsyncContextParallel(chunks=bad)
    assert AsyncContextParallel().overlap and not ContextParallel().overlap
    assert ContextParallel(overlap=True, chunks=3).chunks == 3
    return True


def test_constructor_errors():
    assert run_dist(2, _errors_case) == [True, True]


# ============================================================================ where chunks join
FORMS = {   # the module's output from BSHD attention (B, S, H, D), and which dim holds the heads
    "heads_last": lambda o: o.transpose(2, 3),                                   # (B, S, D, H)
    "head_major": lambda o: o.reshape(o.shape[0], o.shape[1], -1),               # (B, S, H*D)
    "dim_major": lambda o: o.transpose(2, 3).reshape(o.shape[0], o.shape[1], -1),  # (B, S, D*H)
}


def _join_case(rank, world, style, form, expected):
    """An output whose head dim its shape cannot tell (D = the chunk's 4 heads): the chunks join on
    the heads (placements in Ulysses, the whole call's shape in all-gather KV) or the call runs
    whole; every call equals one device. Returns the chunks pipelined in the third call."""
    import torch
    import torch.nn.functional as F
    from hyper_parallel import AsyncContextParallel
    from hyper_parallel.core.context_parallel.overlap.pipeline import observe_pipeline
    reshape = FORMS[form]

    class Attention(torch.nn.Module):
        def forward(self, q, k, v):
            out = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True)
            return reshape(out.transpose(1, 2))

    gen = torch.Generator().manual_seed(5)
    full = [torch.randn(_shape("bshd", 8, 8), generator=gen) for _ in range(3)]
    ref_leaves = [_leaf(t) for t in full]
    ref = reshape(_reference(*ref_leaves, "bshd", True))
    w = torch.randn(ref.shape, generator=gen)
    (ref * w).sum().backward()
    me = rank
    module = AsyncContextParallel(seq_dim=1, head_dim=2, **style).apply(Attention(), _cp_mesh(world))
    for call in range(3):
        leaves = [_leaf(t.chunk(world, 1)[me]) for t in full]
        seen = set()
        with observe_pipeline(lambda stage, chunk, event: seen.add(chunk)):
            out = module(*leaves)
            (out * w.chunk(world, 1)[me]).sum().backward()
        torch.testing.assert_close(out, ref.chunk(world, 1)[me], **TOL, msg=lambda m: f"{form} {call}: {m}")
        for name, leaf, ref_leaf in zip("qkv", leaves, ref_leaves):
            torch.testing.assert_close(leaf.grad, ref_leaf.grad.chunk(world, 1)[me], **TOL,
                                       msg=lambda m, n=name: f"d{n} {form} call {call}: {m}")
    assert len(seen) == expected, f"{style} {form}: {len(seen)} chunks pipelined, expected {expected}"
    return len(seen)


@pytest.mark.parametrize("style,form,expected", [
    (UL, "heads_last", 2), (UL, "head_major", 2), (UL, "dim_major", 0),
    (AG, "heads_last", 2), (AG, "head_major", 0), (AG, "dim_major", 0),
])
def test_chunks_join_on_the_heads_or_run_whole(style, form, expected):
    """Never joined on a dim that is not the heads': a (B, S, D, H) output with D equal to a chunk's
    heads joins on H; a flattened output joins only where Ulysses' placements vouch for the order."""
    assert run_dist(2, _join_case, style, form, expected) == [expected] * 2


# ============================================================================ start_attention
@pytest.mark.parametrize("framework,world", framework_worlds(2))
def test_start_attention_equals_one_device(framework, world):
    """The split call (start, then finish) in Ulysses, all-gather KV (both split) and load balance
    (runs whole at start): output and dq, dk, dv of one device."""
    plan = [({}, [("bshd", "sdpa", True), ("bnsd", "matmul", False)]),
            ({"ulysses_degree": 1}, [("bshd", "matmul", True), ("bnsd", "sdpa", False)]),
            ({"ulysses_degree": 1, "load_balance": True}, [("bshd", "sdpa", True)])]
    for checks in run_on(framework, world, overlap_cases.split_grid, plan, timeout=600):
        assert len(checks) == 5, checks


def _not_applied_case(rank, world):
    from hyper_parallel import start_attention
    from tests.frameworks.torch_adapter import TorchAdapter
    with pytest.raises(ValueError, match="no ContextParallel applied"):
        start_attention(TorchAdapter.attention("sdpa"))
    return True


def test_start_attention_needs_context_parallel():
    assert run_dist(2, _not_applied_case) == [True, True]


# ============================================================================ both platforms
@pytest.mark.parametrize("framework,world", [p for p in framework_worlds(2) if p.values[0] == "mindspore"])
def test_overlap_neutral_mindspore(framework, world):
    """MindSpore runs the same pipeline (2 chunks, H=8 on 2 ranks) with asynchronous split
    collectives: same values; in backward chunk 1's input-gradient collective is in flight while
    chunk 0's output gradient arrives (MindSpore waits for it before chunk 0's attention backward,
    where torch's newest-first engine runs that attention first: see split_collectives.py)."""
    plan = [({"overlap": True}, [("bshd", "sdpa", True), ("bnsd", "matmul", False)]),
            ({"ulysses_degree": 1, "overlap": True}, [("bshd", "matmul", True)])]
    done = run_on(framework, world, overlap_cases.overlapped_grid, plan, 16, timeout=600)
    for checks, events in done:
        assert len(checks) == 3
        events = [tuple(e) for e in events]
        assert {("in", c, "start") for c in (0, 1)} <= set(events) and ("out", 1, "wait") in events, events
        at = {}
        for i, e in enumerate(events):   # the first point's events (each point runs them all)
            at.setdefault(e, i)
        assert at[("in", 1, "grad_start")] < at[("out", 0, "grad_wait")] < at[("in", 1, "grad_wait")], events
        for stage, chunk in {e[:2] for e in events}:
            assert at[(stage, chunk, "grad_start")] < at[(stage, chunk, "grad_wait")], events


def _dtensor_case(rank, world, layout):
    """A CP DTensor q, k, v in -> a CP DTensor out (Shard(seq)), values and gradients of one device."""
    import torch
    from hyper_parallel import AsyncContextParallel, DTensor, Shard
    from tests.frameworks.torch_adapter import TorchAdapter
    seq, head = LAYOUTS[layout]
    mesh = _cp_mesh(world)
    gen = torch.Generator().manual_seed(3)
    full = [torch.randn(_shape(layout, 8, 4), generator=gen) for _ in range(3)]
    ref_leaves = [_leaf(t) for t in full]
    ref = _reference(*ref_leaves, layout, True)
    ref.sum().backward()
    me = mesh.get_local_rank()
    leaves = [_leaf(t.chunk(world, seq)[me]) for t in full]
    dts = [DTensor.from_local(t, mesh, [Shard(seq)]) for t in leaves]
    module = AsyncContextParallel(seq_dim=seq, head_dim=head).apply(
        TorchAdapter.attention("sdpa", layout), mesh)
    out = module(*dts, causal=True)
    assert isinstance(out, DTensor) and tuple(out.placements) == (Shard(seq),), out
    torch.testing.assert_close(out.to_local(), ref.chunk(world, seq)[me], **TOL)
    out.to_local().sum().backward()
    for leaf, ref_leaf in zip(leaves, ref_leaves):
        torch.testing.assert_close(leaf.grad, ref_leaf.grad.chunk(world, seq)[me], **TOL)
    return True


@pytest.mark.parametrize("layout", ["bshd", "bnsd"])
def test_overlap_dtensor_in_dtensor_out(layout):
    assert run_dist(2, _dtensor_case, layout) == [True, True]
