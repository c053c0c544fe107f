"""The Ascend NPU path (SPEC §1, §4, §6) on CPU/gloo, through an emulation of torch_npu.

No NPU exists here, so ``tests/npu_emulation`` provides ``torch_npu.npu_fusion_attention`` in plain
torch (its documented semantics: layouts, sparse modes, masks, outputs), installed as a fake
``torch_npu`` module. The distributed cases keep the workers' torch platform (the DTensor class is
built from it at import time, and NpuPlatform shares that DTensor base) and register the fake
kernel for DTensor dispatch with the same function NpuPlatform uses for the real one
(``hyper_parallel.platform.npu.op_names.register_npu_op_names``). The attention modules then call
``torch_npu.npu_fusion_attention`` on q, k, v exactly as NPU model code does, and ContextParallel
(Ulysses, all-gather KV, hybrid, load balance) is compared with the single-device kernel: output
and dq, dk, dv within 1e-5 (fp32), for every layout, sparse modes 0/1/2/3/4, GQA, 2-D and 4-D
masks, and TND with three packed sequences.
"""
import importlib.util
import itertools
import random

import pytest

from tests.harness import run_dist

B, N, D = 2, 4, 8
TOL = {"atol": 1e-5, "rtol": 1e-5}
INT_MAX = 2147483647
# layout -> (seq_dim, head_dim) for ContextParallel
LAYOUT_DIMS = {"BSH": (1, 2), "SBH": (0, 2), "BSND": (1, 2), "BNSD": (2, 1), "TND": (0, 1)}
MODES = {"ulysses": {"ulysses_degree": None}, "allgather": {"ulysses_degree": 1},
         "hybrid": {"ulysses_degree": 2}, "load_balance": {"ulysses_degree": 1, "load_balance": True}}
# TND: three packed sequences; queries 5 + 7 + 4, keys 7 + 9 + 8 (cumulative ends)
TND_Q, TND_KV = [5, 12, 16], [7, 16, 24]


# ============================================================================ inputs
def _shape(layout, s, heads, b=B):
    return {"BSH": (b, s, heads * D), "SBH": (s, b, heads * D), "BSND": (b, s, heads, D),
            "BNSD": (b, heads, s, D), "TND": (s, heads, D)}[layout]


def _sparse_case(name, sq, skv, seed=3, batch=B):
    """Kernel keyword arguments of one masking case (global, as the single-device call takes)."""
    import torch
    from tests.npu_emulation import compressed_mask
    if name == "none":
        return {"sparse_mode": 0}
    if name == "none_band_ignored":       # sparse_mode 0 without a mask ignores pre/next tokens
        return {"sparse_mode": 0, "pre_tockens": 1, "next_tockens": 0}
    if name in ("mask", "mask_band", "mask4d", "allmask"):
        gen = torch.Generator().manual_seed(seed)
        shape = (batch, N, sq, skv) if name == "mask4d" else (sq, skv)
        masked = torch.rand(shape, generator=gen) < 0.4
        masked &= ~torch.eye(sq, skv, dtype=torch.bool)      # every row keeps its diagonal key
        kwargs = {"sparse_mode": 1 if name == "allmask" else 0, "atten_mask": masked}
        if name == "mask_band":
            kwargs.update(pre_tockens=5, next_tockens=2)
        return kwargs
    if name == "causal2":
        return {"sparse_mode": 2, "atten_mask": compressed_mask()}
    if name == "causal3":
        return {"sparse_mode": 3, "atten_mask": compressed_mask()}
    if name == "band4":
        return {"sparse_mode": 4, "atten_mask": compressed_mask(), "pre_tockens": 6, "next_tockens": 2}
    raise ValueError(name)


def _full_inputs(layout, sq, skv, n2, seed=0, batch=B):
    import torch
    gen = torch.Generator().manual_seed(seed)
    shapes = [_shape(layout, sq, N, batch), _shape(layout, skv, n2, batch), _shape(layout, skv, n2, batch),
              _shape(layout, sq, N, batch)]
    return [torch.randn(s, generator=gen) for s in shapes]


def _npu_attention_module(layout, kernel_kwargs):
    """What NPU model code writes: the fused kernel on q, k, v, its first output returned."""
    import torch

    class NpuCoreAttention(torch.nn.Module):
        def forward(self, q, k, v):
            import torch_npu
            return torch_npu.npu_fusion_attention(q, k, v, N, layout, scale=D ** -0.5, **kernel_kwargs)[0]

    return NpuCoreAttention()


def _leaf(t):
    return t.detach().clone().requires_grad_(True)


def _close(got, expected, what):
    import torch
    torch.testing.assert_close(got, expected, **TOL, msg=lambda m: f"{what}: {m}")


# ============================================================================ ContextParallel vs one device
def _check_cp(rank, world, mesh, mode, layout, case, sq, skv, n2=N):
    from hyper_parallel import ContextParallel

    seq, head = LAYOUT_DIMS[layout]
    kernel_kwargs = _sparse_case(case, sq, skv)
    if layout == "TND":
        kernel_kwargs.update(actual_seq_qlen=TND_Q, actual_seq_kvlen=TND_KV)
    q, k, v, w = _full_inputs(layout, sq, skv, n2)
    ref_leaves = [_leaf(t) for t in (q, k, v)]
    ref = _npu_attention_module(layout, kernel_kwargs)(*ref_leaves)
    (ref * w).sum().backward()

    leaves = [_leaf(t.chunk(world, seq)[rank]) for t in (q, k, v)]
    module = ContextParallel(seq_dim=seq, head_dim=head, **MODES[mode]).apply(
        _npu_attention_module(layout, kernel_kwargs), mesh)
    out = module(*leaves)
    where = f"{mode} {layout} {case} Sq={sq} Skv={skv} N2={n2}"
    assert not hasattr(out, "placements"), where
    _close(out, ref.chunk(world, seq)[rank], f"out {where}")
    (out * w.chunk(world, seq)[rank]).sum().backward()
    for name, leaf, ref_leaf in zip("qkv", leaves, ref_leaves):
        _close(leaf.grad, ref_leaf.grad.chunk(world, seq)[rank], f"d{name} {where}")


def _cp_case(rank, world, checks):
    import os
    from hyper_parallel import init_device_mesh
    from tests.npu_emulation import npu_path

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    strict = os.environ.get("HP_STRICT_DISPATCH")
    os.environ["HP_STRICT_DISPATCH"] = "1"   # the kernel must run through its rule, never replicated
    try:
        with npu_path():
            for check in checks:
                _check_cp(rank, world, mesh, *check)
    finally:
        if strict is None:
            del os.environ["HP_STRICT_DISPATCH"]
        else:
            os.environ["HP_STRICT_DISPATCH"] = strict
    return len(checks)


DENSE_CASES = [("none", 16, 16), ("mask_band", 16, 16), ("causal2", 16, 16), ("causal3", 16, 24),
               ("band4", 16, 16)]


def _dense_plan():
    plan = []
    for mode in MODES:
        for layout in ("BSH", "SBH", "BSND", "BNSD"):
            for case, sq, skv in DENSE_CASES:
                plan.append((mode, layout, case, sq, skv))
    # extra masking forms and GQA (2 key/value heads: not Ulysses over 4 ranks)
    plan += [(m, "BNSD", "mask4d", 16, 16) for m in MODES]
    plan += [(m, "BSND", "allmask", 16, 24) for m in ("allgather", "load_balance")]
    plan += [("allgather", "BSH", "none_band_ignored", 16, 16), ("load_balance", "BSH", "causal2", 16, 24),
             ("load_balance", "SBH", "band4", 16, 24)]
    plan += [(m, lay, "causal3", 16, 24, 2) for m in ("allgather", "hybrid", "load_balance")
             for lay in ("BSH", "BNSD")]
    return plan


def _tnd_plan():
    return [(mode, "TND", case, TND_Q[-1], TND_KV[-1]) for mode in MODES
            for case in ("none", "causal2", "causal3", "band4")]


@pytest.mark.parametrize("plan", ["dense", "tnd"])
def test_context_parallel_through_npu_fusion_attention(plan):
    checks = _dense_plan() if plan == "dense" else _tnd_plan()
    assert run_dist(4, _cp_case, checks, timeout=900) == [len(checks)] * 4


# ============================================================================ the rule on DTensors directly
def _direct_case(rank, world):
    from tests.npu_emulation import npu_path
    with npu_path() as torch_npu:
        return _direct_checks(world, torch_npu)


def _direct_checks(world, torch_npu):
    """Batch / heads / sequence splits of q, k, v given as DTensors: every output (attention and the
    softmax statistics) has the documented global shape and equals the single-device result;
    K/V split along the sequence and indivisible heads are ValueErrors on every rank."""
    import torch
    from hyper_parallel import init_device_mesh
    from hyper_parallel.core.dtensor import DTensor, distribute_tensor
    from hyper_parallel.core.dtensor.placement_types import Replicate, Shard

    mesh = init_device_mesh("cpu", (world,))
    R = Replicate()

    def compare(layout, placements, kwargs, sq=16, skv=16, n2=N, heads=N, batch=B):
        q, k, v, w = _full_inputs(layout, sq, skv, n2, batch=batch)
        ref = torch_npu.npu_fusion_attention(q, k, v, heads, layout, scale=0.3, **kwargs)
        dts = [distribute_tensor(t, mesh, [p]) for t, p in zip((q, k, v), placements)]
        got = torch_npu.npu_fusion_attention(*dts, heads, layout, scale=0.3, **kwargs)
        for i in range(3):
            assert isinstance(got[i], DTensor), (layout, placements, i)
            assert tuple(got[i].shape) == tuple(ref[i].shape), (layout, placements, i, got[i].shape)
            what = f"output {i} {layout} {placements} sparse_mode={kwargs.get('sparse_mode')}"
            _close(got[i].full_tensor(), ref[i], what)
        return got

    causal = _sparse_case("causal2", 16, 16)
    # batch split, with a 4-D (B, N, Sq, Skv) mask sliced by batch
    got = compare("BSND", [Shard(0)] * 3, _sparse_case("mask4d", 16, 16, batch=world), batch=world)
    assert got[0].placements == (Shard(0),) and got[1].placements == (Shard(0),)
    # heads split (hidden of BSH): head_num becomes local; statistics split over N
    got = compare("BSH", [Shard(2)] * 3, causal)
    assert got[1].placements == (Shard(1),)
    # queries split along S, K/V replicated: causal offset; statistics split along S (dim 2)
    got = compare("BNSD", [Shard(2), R, R], _sparse_case("band4", 16, 24), skv=24)
    assert got[1].placements == (Shard(2),)
    # TND split along T: statistics (T, N, 8) split along T
    got = compare("TND", [Shard(0), R, R], dict(_sparse_case("causal3", 16, 24), actual_seq_qlen=TND_Q,
                                                actual_seq_kvlen=TND_KV), skv=24)
    assert got[1].placements == (Shard(0),) and tuple(got[1].shape) == (16, N, 8)

    errors = 0
    q, k, v, _ = _full_inputs("BSND", 16, 16, N)
    seq_split = [distribute_tensor(t, mesh, [Shard(1)]) for t in (q, k, v)]
    try:
        torch_npu.npu_fusion_attention(*seq_split, N, "BSND", **causal)
    except ValueError as exc:
        assert "ring" in str(exc), exc
        errors += 1
    three_heads = torch.randn(B, 16, 3 * D)          # 3 heads (hidden 24) over 4 ranks
    heads_split = [distribute_tensor(three_heads, mesh, [Shard(2)]) for _ in range(3)]
    try:
        torch_npu.npu_fusion_attention(*heads_split, 3, "BSH", **causal)
    except ValueError as exc:
        assert "divisible" in str(exc), exc
        errors += 1
    q_split = [distribute_tensor(q, mesh, [Shard(1)])] + [distribute_tensor(t, mesh, [R]) for t in (k, v)]
    try:
        torch_npu.npu_fusion_attention(*q_split, N, "BSND", sparse_mode=6, prefix=[4, 4])
    except ValueError as exc:
        assert "sparse_mode=6" in str(exc), exc
        errors += 1

    # NpuPlatform itself on gloo (test subclass): its kernel entry point and its avg reduce-scatter
    from tests.npu_emulation import cpu_npu_platform
    platform = cpu_npu_platform()
    dts = [distribute_tensor(q, mesh, [Shard(1)])] + [distribute_tensor(t, mesh, [R]) for t in (k, v)]
    out = platform.npu_fusion_attention(*dts, N, "BSND", **causal)[0]
    assert out.placements == (Shard(1),)
    ref = torch_npu.npu_fusion_attention(q, k, v, N, "BSND", **causal)[0]
    _close(out.full_tensor(), ref, "platform kernel")
    x = torch.arange(world * 3.0).reshape(world, 3) * (torch.distributed.get_rank() + 1)
    expected = (torch.arange(world * 3.0).reshape(world, 3) * sum(range(1, world + 1)) / world)[
        torch.distributed.get_rank()]
    _close(platform.reduce_scatter(x, None, 0, "avg").reshape(-1), expected, "reduce_scatter avg")
    handle = platform.reduce_scatter(x, None, 0, "avg", async_op=True)
    _close(handle.wait().reshape(-1), expected, "async avg")
    return errors


def _ulysses_indivisible_case(rank, world):
    """BSH with 3 heads (hidden 24): ContextParallel's hidden-size check passes for 4 ranks, the
    rule refuses to split a head."""
    import torch
    from hyper_parallel import ContextParallel, init_device_mesh
    from tests.npu_emulation import npu_path

    mesh = init_device_mesh("cpu", (world,))

    class ThreeHeads(torch.nn.Module):
        def forward(self, q, k, v):
            import torch_npu
            return torch_npu.npu_fusion_attention(q, k, v, 3, "BSH", **_sparse_case("causal2", 16, 16))[0]

    q, k, v = (torch.randn(B, 4, 3 * D) for _ in range(3))
    module = ContextParallel(seq_dim=1, head_dim=2).apply(ThreeHeads(), mesh)
    with npu_path(), pytest.raises(ValueError, match="divisible"):
        module(q, k, v)
    return True


def test_rule_on_dtensors_and_errors():
    assert run_dist(4, _direct_case, timeout=600) == [3] * 4
    assert run_dist(4, _ulysses_indivisible_case, timeout=300) == [True] * 4


# ============================================================================ single process
def test_local_band_matches_global_mask():
    """For random problems and query blocks, the rewritten kernel call (keys [k0, k1), new mode,
    pre/next tokens) sees exactly the keys the global mask gives those rows."""
    import torch
    from hyper_parallel.core.dtensor.ops.npu_attention import local_band
    from tests.npu_emulation import visible_keys

    rnd = random.Random(0)
    checked = empty = 0
    for _ in range(600):
        mode = rnd.choice([0, 1, 2, 3, 4])
        sq, skv = rnd.randint(1, 12), rnd.randint(1, 12)
        o = rnd.randint(0, sq - 1)
        lq = rnd.randint(1, sq - o)
        pre = rnd.choice([INT_MAX, rnd.randint(0, 14)])
        nxt = rnd.choice([INT_MAX, rnd.randint(0, 14)])
        has_mask = mode == 1 or (mode == 0 and rnd.random() < 0.8)
        gen = torch.Generator().manual_seed(checked)
        mask = torch.rand(sq, skv, generator=gen) < 0.3 if has_mask else None
        glob = visible_keys(mode, pre, nxt, sq, skv, mask)
        glob = torch.ones(sq, skv, dtype=torch.bool) if glob is None else glob
        expected = glob[o:o + lq]
        band = local_band(mode, pre, nxt, has_mask, o, lq, sq, skv)
        if band is None:   # no row sees a key: the rule emits a placeholder call (empty_rows_call)
            assert not expected.any(), (mode, pre, nxt, has_mask, o, lq, sq, skv)
            empty += 1
            checked += 1
            continue
        k0, k1, mode_l, pre_l, nxt_l = band
        assert 0 <= k0 < k1 <= skv
        assert pre_l >= 0 and nxt_l >= 0, (mode, pre, nxt, o, lq, sq, skv, band)   # documented range
        local_mask = mask[o:o + lq, k0:k1] if (has_mask and mode_l in (0, 1)) else None
        loc = visible_keys(mode_l, pre_l, nxt_l, lq, k1 - k0, local_mask)
        loc = torch.ones(lq, k1 - k0, dtype=torch.bool) if loc is None else loc
        expected = glob[o:o + lq]
        got = torch.zeros(lq, skv, dtype=torch.bool)
        got[:, k0:k1] = loc
        assert torch.equal(got, expected), (mode, pre, nxt, has_mask, o, lq, sq, skv,
                                            (k0, k1, mode_l, pre_l, nxt_l))
        if mode == 2 and k1 == o + lq:
            assert mode_l == 3                         # left-up causal -> right-down on the prefix
        assert pre_l <= INT_MAX and nxt_l <= INT_MAX
        checked += 1
    assert checked == 600 and empty > 0


def test_emulation_agrees_with_sdpa():
    """The emulated kernel against F.scaled_dot_product_attention, per layout and sparse mode."""
    import torch
    import torch.nn.functional as F
    from tests.npu_emulation import compressed_mask, npu_fusion_attention, visible_keys

    def to_bnsd(t, layout, heads):
        if layout == "BSH":
            return t.view(B, t.shape[1], heads, D).transpose(1, 2)
        if layout == "SBH":
            return t.view(t.shape[0], B, heads, D).permute(1, 2, 0, 3)
        return t.transpose(1, 2) if layout == "BSND" else t

    for layout, (mode, pre, nxt), n2 in itertools.product(
            ("BSH", "SBH", "BSND", "BNSD"), [(2, 0, 0), (3, 0, 0), (4, 3, 1), (0, 2, 1)], (N, 2)):
        sq, skv = 6, 9
        q, k, v, _ = _full_inputs(layout, sq, skv, n2)
        mask = compressed_mask() if mode else torch.eye(sq, skv, dtype=torch.bool).roll(1, 1)
        out, row_max, row_sum, extra, *_ = npu_fusion_attention(
            q, k, v, N, layout, atten_mask=mask, scale=0.25, sparse_mode=mode, pre_tockens=pre,
            next_tockens=nxt)
        allowed = visible_keys(mode, pre, nxt, sq, skv, None if mode else mask)
        qb, kb, vb = to_bnsd(q, layout, N), to_bnsd(k, layout, n2), to_bnsd(v, layout, n2)
        ref = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=allowed, scale=0.25, enable_gqa=n2 != N)
        _close(to_bnsd(out, layout, N), ref, f"{layout} mode {mode} N2={n2}")
        assert row_max.shape == (B, N, sq, 8) and row_max.dtype == torch.float32 and extra.numel() == 0
        scores = qb @ kb.repeat_interleave(N // n2, 1).transpose(-1, -2) * 0.25
        scores = scores.masked_fill(~allowed, float("-inf"))
        _close(row_max[..., 0], scores.amax(-1), "softmax_max")
        _close(row_sum[..., 0], torch.exp(scores - scores.amax(-1, keepdim=True)).sum(-1), "softmax_sum")
    # TND: three packed sequences, each attends only within itself
    q, k, v, _ = _full_inputs("TND", 16, 24, 2)
    out = npu_fusion_attention(q, k, v, N, "TND", atten_mask=compressed_mask(), sparse_mode=3,
                               actual_seq_qlen=TND_Q, actual_seq_kvlen=TND_KV)
    starts_q, starts_kv = [0] + TND_Q[:-1], [0] + TND_KV[:-1]
    for a, b, c, d in zip(starts_q, TND_Q, starts_kv, TND_KV):
        ref = F.scaled_dot_product_attention(
            q[a:b].transpose(0, 1), k[c:d].transpose(0, 1), v[c:d].transpose(0, 1),
            attn_mask=visible_keys(3, 0, 0, b - a, d - c), scale=1.0, enable_gqa=True)
        _close(out[0][a:b], ref.transpose(0, 1), "TND")
    assert out[1].shape == (16, N, 8)


@pytest.fixture
def emulated_torch_npu(monkeypatch):
    """The fake torch_npu in sys.modules, a torch.npu shim, HP_PLATFORM=npu; the process-wide
    platform and OP_NAMES are restored afterwards."""
    import torch
    from hyper_parallel.platform import selection
    from hyper_parallel.platform.torch import dtensor_base
    from tests.npu_emulation import install, uninstall

    if importlib.util.find_spec("torch_npu") is not None and "torch_npu" not in __import__("sys").modules:
        pytest.skip("a real torch_npu is installed")
    saved_platform, saved_names = selection._platform, dict(dtensor_base.OP_NAMES)
    module = install()

    class _NpuShim:
        Stream = staticmethod(lambda: ("stream",))
        Event = staticmethod(lambda enable_timing=False: ("event", enable_timing))
        stream = staticmethod(lambda s: ("context", s))
        current_stream = staticmethod(lambda: ("current",))

    monkeypatch.setattr(torch, "npu", _NpuShim(), raising=False)
    monkeypatch.setenv("HP_PLATFORM", "npu")
    monkeypatch.delenv("HYPER_PARALLEL_PLATFORM", raising=False)
    selection._platform = None
    try:
        yield module
    finally:
        selection._platform = saved_platform
        dtensor_base.OP_NAMES.clear()
        dtensor_base.OP_NAMES.update(saved_names)
        uninstall()


def test_hp_platform_npu_selects_npu_platform(emulated_torch_npu):
    from hyper_parallel.platform import get_platform
    from hyper_parallel.platform.npu.platform import NpuPlatform
    from hyper_parallel.platform.torch.dtensor_base import OP_NAMES
    from hyper_parallel.platform.torch.platform import TorchPlatform

    platform = get_platform()
    assert isinstance(platform, NpuPlatform) and platform.name == "npu"
    assert platform.DTensorBase is TorchPlatform.DTensorBase      # one DTensor class for torch and NPU
    assert platform.device_type == "npu" and platform.default_backend == "hccl"
    table = platform.capabilities()
    assert table["backend"] == "hccl" and table["attention kernel"] == "torch_npu.npu_fusion_attention"
    for key in ("all_reduce avg", "reduce_scatter avg"):
        assert table[key].startswith("emulated"), (key, table[key])
    assert platform.torch_npu is emulated_torch_npu
    assert OP_NAMES[emulated_torch_npu.npu_fusion_attention] == "npu_fusion_attention"
    assert platform.new_stream() == ("stream",) and platform.current_stream() == ("current",)
    assert platform.stream("s") == ("context", "s") and platform.new_event(True) == ("event", True)
    import torch
    q = torch.randn(1, 2, 4, D)
    out = platform.npu_fusion_attention(q, q, q, 2, "BNSD", scale=1.0)
    torch.testing.assert_close(out[0], emulated_torch_npu.npu_fusion_attention(q, q, q, 2, "BNSD")[0])


def test_missing_torch_npu_is_the_spec_import_error(monkeypatch):
    """SPEC §1: HP_PLATFORM=npu without torch_npu -> ImportError naming it and the extra."""
    from hyper_parallel.platform import selection

    if importlib.util.find_spec("torch_npu") is not None:
        pytest.skip("torch_npu is importable here")
    saved = selection._platform
    monkeypatch.setenv("HP_PLATFORM", "NPU")
    selection._platform = None
    try:
        with pytest.raises(ImportError, match=r"torch_npu.*hyper-parallel\[npu\]"):
            selection.get_platform()
    finally:
        selection._platform = saved


# ============================================================================ packed TND, empty blocks
def _packed_and_empty_case(rank, world):
    from tests.npu_emulation import npu_path
    with npu_path() as torch_npu:
        return _packed_and_empty_checks(world, torch_npu)


def _spy_band(calls):
    """Record (sparse_mode, pre, next) of every local kernel call (the fake's _impl)."""
    from tests.npu_emulation import fake_torch_npu
    impl = fake_torch_npu._impl

    def spy(*args, **kwargs):
        calls.append((int(kwargs.get("sparse_mode", 0)), int(kwargs.get("pre_tockens", INT_MAX)),
                      int(kwargs.get("next_tockens", INT_MAX))))
        return impl(*args, **kwargs)
    fake_torch_npu._impl = spy
    return impl


def _compare_grads(torch_npu, mesh, placements, layout, kwargs, sq, skv):
    """Outputs and dq, dk, dv of the DTensor call against the single-device kernel."""
    from hyper_parallel.core.dtensor import distribute_tensor
    q, k, v, w = _full_inputs(layout, sq, skv, N)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    ref = torch_npu.npu_fusion_attention(*leaves, N, layout, scale=0.3, **kwargs)
    (ref[0] * w).sum().backward()
    dts = [distribute_tensor(t.clone().requires_grad_(True), mesh, [p]) for t, p in zip((q, k, v), placements)]
    got = torch_npu.npu_fusion_attention(*dts, N, layout, scale=0.3, **kwargs)
    what = f"{layout} {placements} {kwargs.get('sparse_mode')} {kwargs.get('actual_seq_qlen')}"
    for i in range(3):
        _close(got[i].full_tensor(), ref[i], f"output {i} {what}")
    (got[0] * distribute_tensor(w, mesh, [placements[0]])).sum().backward()
    for name, dt, leaf in zip("qkv", dts, leaves):
        _close(dt.grad.full_tensor(), leaf.grad, f"d{name} {what}")


def _packed_and_empty_checks(world, torch_npu):
    """TND with q, k, v all split along T (whole sequences per rank: actual_seq_*len rebased per
    rank) for every sparse mode; a T split that cuts a sequence is a ValueError on every rank;
    query blocks that see no key (right-down causal with fewer keys than queries, dense and TND)
    equal one device, and no local call gets a negative pre/next token count."""
    from hyper_parallel import init_device_mesh
    from hyper_parallel.core.dtensor import distribute_tensor
    from hyper_parallel.core.dtensor.placement_types import Replicate, Shard
    from tests.npu_emulation import fake_torch_npu

    mesh = init_device_mesh("cpu", (world,))
    T = Shard(0)
    # 6 packed sequences; rank ends (T/4 = 4 queries, 6 keys) fall on sequence ends 1, 3, 5
    cq, ckv = [4, 5, 8, 10, 12, 16], [6, 8, 12, 15, 18, 24]
    done = 0
    for case in ("none", "causal2", "causal3", "band4"):
        kwargs = dict(_sparse_case(case, 16, 24), actual_seq_qlen=cq, actual_seq_kvlen=ckv)
        _compare_grads(torch_npu, mesh, [T, T, T], "TND", kwargs, 16, 24)
        done += 1
    q, k, v, _ = _full_inputs("TND", 16, 24, N)
    cut = [distribute_tensor(t, mesh, [T]) for t in (q, k, v)]
    try:
        torch_npu.npu_fusion_attention(*cut, N, "TND", actual_seq_qlen=TND_Q, actual_seq_kvlen=TND_KV,
                                       **_sparse_case("causal3", 16, 24))
    except ValueError as exc:
        assert "whole" in str(exc) and "sequences" in str(exc), exc
        done += 1

    calls = []
    impl = _spy_band(calls)
    try:
        R = Replicate()
        causal3 = _sparse_case("causal3", 16, 4)
        _compare_grads(torch_npu, mesh, [Shard(1), R, R], "BSND", causal3, 16, 4)   # rows < 12 see nothing
        tnd = dict(causal3, actual_seq_qlen=[8, 16], actual_seq_kvlen=[2, 6])       # 8 queries, 2 / 4 keys
        _compare_grads(torch_npu, mesh, [T, R, R], "TND", tnd, 16, 6)
        band = dict(_sparse_case("band4", 16, 16), pre_tockens=0, next_tockens=0)
        _compare_grads(torch_npu, mesh, [Shard(2), R, R], "BNSD", band, 16, 16)
    finally:
        fake_torch_npu._impl = impl
    bad = [c for c in calls if c[1] < 0 or c[2] < 0]
    assert calls and not bad, bad
    return done + 3


def test_packed_tnd_split_and_empty_blocks():
    assert run_dist(4, _packed_and_empty_case, timeout=600) == [8] * 4
