"""ContextParallel's contract beyond "equals single device": the output layout follows the output
(Hugging Face style BNSD in, BSHD or (B, S, H*D) out), mixed q/k/v placements, validated dims,
NaN/inf isolation under the causal mask, and mismatched ranks.

Every rank builds the full inputs from one seed and computes single-process attention as the
reference; its own block goes through the ContextParallel module. Outputs and the gradients of q,
k, v (and of a projection after attention) must match within 1e-5 (fp32). Errors must be
ValueErrors raised on every rank while only the "shape_check" all-reduce has run.
"""
from tests.harness import run_dist

B, D = 2, 4
TOL = {"atol": 1e-5, "rtol": 1e-5}
UL, AG, HY = {"ulysses_degree": None}, {"ulysses_degree": 1}, {"ulysses_degree": 2}
LB = {"ulysses_degree": 1, "load_balance": True}
RING = {"ulysses_degree": 1, "kv_exchange": "ring"}
ZIGZAG = {"ulysses_degree": 1, "load_balance": True, "kv_exchange": "ring"}
HY_RING = {"ulysses_degree": 2, "kv_exchange": "ring"}
ALL_MODES = (UL, AG, HY, LB, RING, ZIGZAG, HY_RING)
LAYOUTS = {"bshd": (1, 2), "bnsd": (2, 1)}   # layout -> (seq_dim, head_dim)


def _attention(layout="bnsd", out="bshd"):
    """Core attention taking ``layout`` q/k/v; HF-style BNSD modules return BSHD (``out="bshd"``)
    or (B, S, H*D) (``out="flat"``); ``out="same"`` returns the input layout."""
    import torch.nn as nn
    import torch.nn.functional as F

    class Attention(nn.Module):
        def forward(self, q, k, v, causal=True):
            if layout == "bshd":
                q, k, v = (t.transpose(1, 2) for t in (q, k, v))
            gqa = {"enable_gqa": True} if q.shape[1] != k.shape[1] else {}
            o = F.scaled_dot_product_attention(q, k, v, is_causal=causal, **gqa)   # BNSD
            if out == "same":
                return o.transpose(1, 2) if layout == "bshd" else o
            o = o.transpose(1, 2)
            return o.reshape(o.shape[0], o.shape[1], -1) if out == "flat" else o

    return Attention()


def _leaf(t):
    return t.detach().clone().requires_grad_(True)


def _close(got, want, what):
    import torch
    torch.testing.assert_close(got, want, **TOL, msg=lambda m: f"{what}: {m}")


def _inputs(layout, S, H, Hkv=None, seed=0, batch=B):
    import torch
    gen = torch.Generator().manual_seed(seed)
    shape = (lambda h: (batch, S, h, D)) if layout == "bshd" else (lambda h: (batch, h, S, D))
    return [torch.randn(shape(h), generator=gen) for h in (H, Hkv or H, Hkv or H)]


def _cp(style, mesh, layout="bnsd", out="bshd"):
    from hyper_parallel import ContextParallel
    seq, head = LAYOUTS[layout]
    return ContextParallel(seq_dim=seq, head_dim=head, **style).apply(_attention(layout, out), mesh)


def _expect_value_error(fn, *words, before_data=True):
    """fn() raises a ValueError naming ``words``; with ``before_data`` while at most the shape
    check all-reduce ran (an output's layout can only be read once the module ran)."""
    from hyper_parallel import CommDebugMode
    with CommDebugMode() as comm:
        try:
            fn()
        except ValueError as exc:
            message = str(exc)
        else:
            raise AssertionError(f"no ValueError (wanted one mentioning {words})")
    for word in words:
        assert word in message, f"{word!r} not in {message!r}"
    if before_data:
        assert set(comm.get_comm_counts()) <= {"shape_check"}, (message, comm.summary())
    return message


# ============================================================================ output layout
def _hf_check(rank, world, mesh, style, out, S=16, H=8, proj=False, batch=B):
    """HF-style attention (BNSD q/k/v, BSHD or (B, S, H*D) output) on this rank's block vs the
    reference: output block along the output's seq dim 1, dq/dk/dv blocks along dim 2, and, with
    ``proj``, the gradient of a Linear after attention summed over ranks."""
    import copy

    import torch
    import torch.distributed as dist
    q, k, v = _inputs("bnsd", S, H, batch=batch)
    linear = torch.nn.Linear(H * D, 3)
    ref_leaves = [_leaf(t) for t in (q, k, v)]
    ref = _attention("bnsd", out)(*ref_leaves)
    w_shape = ref.shape if not proj else ref.shape[:2] + (3,)
    w = torch.randn(w_shape, generator=torch.Generator().manual_seed(9))
    head = linear(ref.reshape(batch, S, -1)) if proj else ref
    (head * w).sum().backward()
    dist_linear = copy.deepcopy(linear)
    dist_linear.zero_grad()
    leaves = [_leaf(t.chunk(world, 2)[rank]) for t in (q, k, v)]
    got = _cp(style, mesh, "bnsd", out)(*leaves)
    what = f"HF out={out} {style}"
    assert not hasattr(got, "placements"), what
    _close(got, ref.chunk(world, 1)[rank], f"out {what}")
    head = dist_linear(got.reshape(batch, S // world, -1)) if proj else got
    (head * w.chunk(world, 1)[rank]).sum().backward()
    for name, leaf, ref_leaf in zip("qkv", leaves, ref_leaves):
        _close(leaf.grad, ref_leaf.grad.chunk(world, 2)[rank], f"d{name} {what}")
    if proj:
        for name, p in dist_linear.named_parameters():
            g = p.grad.clone()
            dist.all_reduce(g)
            _close(g, getattr(linear, name).grad, f"d{name} (summed) {what}")


def _output_layout_case(rank, world):
    from hyper_parallel import DTensor, Shard, init_device_mesh
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    for style in ALL_MODES:
        _hf_check(rank, world, mesh, style, "bshd")
        _hf_check(rank, world, mesh, style, "flat", proj=True)
    # a CP DTensor in -> a CP DTensor out, split on the output's own sequence dim
    q, k, v = _inputs("bnsd", 16, 8)
    ref = _attention("bnsd", "flat")(q, k, v)
    for style in (UL, AG, LB, RING):
        dts = [DTensor.from_local(t.chunk(world, 2)[rank], mesh, [Shard(2)]) for t in (q, k, v)]
        got = _cp(style, mesh, "bnsd", "flat")(*dts)
        assert isinstance(got, DTensor) and tuple(got.placements) == (Shard(1),), (style, got.placements)
        assert tuple(got.shape) == tuple(ref.shape), (style, got.shape)
        _close(got.to_local(), ref.chunk(world, 1)[rank], f"DTensor in, flat out {style}")
    # Ulysses cannot tell batch from sequence when both are S long: a ValueError naming the dims
    q, k, v = (t.chunk(world, 2)[rank] for t in _inputs("bnsd", world, 8, batch=world))
    _expect_value_error(lambda: _cp(UL, mesh, "bnsd", "flat")(q, k, v), "dims [0, 1]", "sequence",
                        before_data=False)
    for style in (AG, HY):   # where the split shows the dim, the same shapes work
        _hf_check(rank, world, mesh, style, "flat", S=world, batch=world)
    return True


def test_output_layout_follows_the_output():
    """HF-style modules in Ulysses, all-gather, hybrid, load balance, ring, zigzag and hybrid ring:
    BSHD and (B, S, H*D) outputs with a projection after attention; DTensor in/out; ambiguity."""
    assert run_dist(4, _output_layout_case, timeout=600) == [True] * 4


# ============================================================================ mixed placements
def _mixed_tp_check(rank, mesh, style, layout, kv_kind, Hkv=None):
    """q a DTensor head-sharded on "tp"; k/v replicated DTensors there, or plain tensors."""
    from hyper_parallel import DTensor, Replicate, Shard
    tp, c = mesh["tp"], mesh["cp"].get_local_rank()
    seq, head = LAYOUTS[layout]
    full = _inputs(layout, 16, 8, Hkv)
    ref_leaves = [_leaf(t) for t in full]
    ref = _attention(layout, "same")(*ref_leaves)
    ref.sum().backward()
    blocks = [_leaf(t.chunk(2, seq)[c]) for t in full]
    q_block = _leaf(blocks[0].chunk(2, head)[tp.get_local_rank()])
    q = DTensor.from_local(q_block, tp, [Shard(head)])
    kv = [DTensor.from_local(t, tp, [Replicate()]) if kv_kind == "replicated" else t for t in blocks[1:]]
    got = _cp(style, mesh["cp"], layout, "same")(q, *kv)
    what = f"TP q, {kv_kind} k/v {style} {layout} Hkv={Hkv}"
    assert isinstance(got, DTensor) and tuple(got.placements) == (Shard(head),), what
    _close(got.full_tensor(), ref.chunk(2, seq)[c], f"out {what}")
    got.to_local().sum().backward()
    dq = ref_leaves[0].grad.chunk(2, seq)[c].chunk(2, head)[tp.get_local_rank()]
    _close(q_block.grad, dq, f"dq {what}")
    for name, leaf, ref_leaf in zip("kv", blocks[1:], ref_leaves[1:]):
        _close(leaf.grad, ref_leaf.grad.chunk(2, seq)[c], f"d{name} {what}")


def _mixed_case(rank, world):
    from hyper_parallel import DTensor, Replicate, Shard, init_device_mesh
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp", "tp"))
    for style in (UL, AG, LB, RING, ZIGZAG):
        for layout in LAYOUTS:
            _mixed_tp_check(rank, mesh, style, layout, "replicated")
        _mixed_tp_check(rank, mesh, style, "bshd", "plain")
        _mixed_tp_check(rank, mesh, style, "bnsd", "replicated", Hkv=4)
    # on the CP mesh: q a CP DTensor, k/v plain local blocks or replicated DTensors (full sequence)
    cp = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    full = _inputs("bshd", 16, 8)
    ref = _attention("bshd", "same")(*full)
    for style in (UL, AG, HY, LB, RING):
        q = DTensor.from_local(full[0].chunk(world, 1)[rank], cp, [Shard(1)])
        for kv in ([t.chunk(world, 1)[rank] for t in full[1:]],
                   [DTensor.from_local(t, cp, [Replicate()]) for t in full[1:]]):
            got = _cp(style, cp, "bshd", "same")(q, *kv)
            _close(got.to_local(), ref.chunk(world, 1)[rank], f"CP q, mixed k/v {style}")
        # a plain k holding the whole sequence beside a CP q is no block: an error, not a guess
        _expect_value_error(lambda: _cp(style, cp, "bshd", "same")(q, *full[1:]), "same length")
    # q a plain block but k a DTensor on another mesh
    k_tp = DTensor.from_local(full[1], mesh["tp"], [Replicate()])
    _expect_value_error(lambda: _cp(UL, cp, "bshd", "same")(full[0].chunk(world, 1)[rank], k_tp, full[2]),
                        "k is a DTensor")
    return True


def test_mixed_qkv_placements():
    """q head-sharded on TP with k/v replicated (or plain) in every mode, GQA, both layouts; CP
    DTensor q with plain / replicated k/v; impossible mixes are ValueErrors."""
    assert run_dist(4, _mixed_case, timeout=600) == [True] * 4


# ============================================================================ dims and ranks
def _dims_and_ranks_case(rank, world):
    """Bad dims, shapes that contradict the dims, and inputs that differ across ranks: a
    ValueError on every rank, in every mode, before any data moves; the ranks stay in step."""
    import torch
    from hyper_parallel import ContextParallel, init_device_mesh
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    q, k, v = (t.chunk(world, 1)[rank] for t in _inputs("bshd", 16, 8))
    k4, v4 = (t.chunk(world, 1)[rank] for t in _inputs("bshd", 16, 8, Hkv=4)[1:])

    def call(style, *qkv, **dims):
        return ContextParallel(**{**style, **dims}).apply(_attention("bshd", "same"), mesh)(*qkv)
    for style in (UL, AG, LB, RING):
        for dims, words in (({"seq_dim": 4}, ("seq_dim=4", "out of range")),
                            ({"seq_dim": -5}, ("seq_dim=-5", "out of range")),
                            ({"head_dim": 7}, ("head_dim=7", "out of range")),
                            ({"seq_dim": -3, "head_dim": 1}, ("seq_dim=-3", "same dim 1"))):
            _expect_value_error(lambda: call(style, q, k, v, **dims), *words)
        # BNSD dims on BSHD data with GQA: q and k/v may differ in length (cross-attention), so this
        # reads as a valid cross-attention except where the mode needs equal lengths (ring)
        if style is RING:
            _expect_value_error(lambda: call(style, q, k4, v4, seq_dim=2, head_dim=1), "seq_dim=1, head_dim=2",
                                "same length")
        # k/v longer than q (each split over the ranks): the ring needs equal lengths
        k2, v2 = torch.cat([k, k], 1), torch.cat([v, v], 1)
        if style is RING:
            _expect_value_error(lambda: call(style, q, k2, v2), "kv_exchange='allgather'", "same length")
        # only k's length differs across ranks
        _expect_value_error(lambda: call(style, q, k2 if rank == 0 else k, v), "k blocks of different shapes")
        q6 = torch.randn(B, q.shape[1], 6, D)
        _expect_value_error(lambda: call(style, q6, k4, v4), "6 heads", "divide")
        _expect_value_error(lambda: call(style, q, k, v4), "k (", "v (")
        # across ranks: dtype, ndim, length (rank 0 differs); then an empty block (S = 0)
        _expect_value_error(lambda: call(style, q.double() if rank == 0 else q, k, v),
                            "q of different dtypes")
        _expect_value_error(lambda: call(style, q, k[0] if rank == 0 else k, v), "different numbers of dims")
        _expect_value_error(lambda: call(style, *(t[:, :1] if rank == 0 else t for t in (q, k, v))),
                            "different shapes")
        _expect_value_error(lambda: call(style, *(t[:, :0] for t in (q, k, v))), "empty")
        if rank < world - 1:   # S = world - 1 < cp: the last rank has no token
            _expect_value_error(lambda: call(style, *(t[:, :1] for t in (q, k, v))), "different shapes")
        else:
            _expect_value_error(lambda: call(style, *(t[:, :0] for t in (q, k, v))), "different shapes")
    _hf_check(rank, world, mesh, RING, "bshd")   # still in step
    return True


def test_dims_and_mismatched_ranks():
    assert run_dist(4, _dims_and_ranks_case, timeout=300) == [True] * 4


# ============================================================================ NaN / inf isolation
def _non_finite_check(rank, world, mesh, style, layout, which, bad):
    """A NaN/inf in k or v at key j (in rank 2's block) against single-device causal sdpa."""
    import torch
    seq = LAYOUTS[layout][0]
    S, j = 16, 9
    full = _inputs(layout, S, 8)
    w = torch.randn(full[0].shape, generator=torch.Generator().manual_seed(3))
    results = {}
    for tag in ("bad", "clean"):
        t = full["qkv".index(which)].clone()
        t.select(seq, j).fill_(bad if tag == "bad" else 0.0)
        inputs = [t if n == which else full["qkv".index(n)] for n in "qkv"]
        ref_leaves = [_leaf(x) for x in inputs]
        ref = _attention(layout, "same")(*ref_leaves)
        (ref * w).sum().backward()
        leaves = [_leaf(x.chunk(world, seq)[rank]) for x in inputs]
        got = _cp(style, mesh, layout, "same")(*leaves)
        (got * w.chunk(world, seq)[rank]).sum().backward()
        mine = lambda x: x.chunk(world, seq)[rank]   # noqa: E731
        results[tag] = [(got.detach(), mine(ref.detach()))] + [(a.grad, mine(b.grad)) for a, b in
                                                               zip(leaves, ref_leaves)]
    attends = torch.zeros(S, dtype=torch.bool)
    attends[j:] = True
    attends = attends.chunk(world)[rank].view([-1 if d == seq else 1 for d in range(4)])
    for i, name in enumerate(("out", "dq", "dk", "dv")):
        what = f"{name} {which}[{j}]={bad} {style} {layout}"
        (got, ref), (_, clean) = results["bad"][i], results["clean"][i]
        got_bad, ref_bad = ~torch.isfinite(got), ~torch.isfinite(ref)
        # never a non-finite output/dq single device keeps finite; a finite value is single device's,
        # or, where single device is non-finite, attention without the bad key: never a wrong number
        if name in ("out", "dq"):   # a row's own output and gradient; dk/dv mix all rows
            assert not (got_bad & ~ref_bad).any(), f"{what}: non-finite where single device is finite"
        want = torch.where(ref_bad, clean, ref)
        _close(torch.where(got_bad, want, got), want, what)
        if name == "out" and which == "k":   # masked scores never include the key: exact
            assert torch.equal(got_bad, ref_bad), f"{what}: non-finite {got_bad} != single device {ref_bad}"
        elif name == "out":
            # a bad value reaches rows that skip it only through 0 * NaN in a kernel's P @ V, which
            # single device (and a mode running its kernel on whole rows) does; the rows that
            # attend to it are non-finite everywhere
            must = ref_bad & attends.expand_as(ref_bad)
            assert not (must & ~got_bad).any(), f"{what}: finite where the row attends to the bad value"


def _nan_case(rank, world):
    from hyper_parallel import init_device_mesh
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    for style in ALL_MODES:
        for layout in LAYOUTS:
            for which in "kv":
                _non_finite_check(rank, world, mesh, style, layout, which, float("nan"))
        _non_finite_check(rank, world, mesh, style, "bshd", "k", float("inf"))
    return True


def test_non_finite_keys_stay_out_of_masked_rows():
    """Single device causal sdpa keeps a NaN/inf key out of the rows that cannot see it; every
    mode must give exactly its non-finite outputs (for k) and never a wrong finite value."""
    assert run_dist(4, _nan_case, timeout=600) == [True] * 4
