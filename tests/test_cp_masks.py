"""ContextParallel under ``attention_masks``: padding masks and packed documents in every mode.

Every rank builds the full q, k, v, the masks and a weight from one seed; the reference is
single-device ``F.scaled_dot_product_attention`` with the equivalent dense boolean mask (documents
equal, key not padding, j <= i when causal), whose fully masked rows give 0 and zero gradients.
The rank's contiguous block then runs through the ContextParallel module inside
``attention_masks(...)`` (global document ids / cu_seqlens / padding, the same on every rank), and
the output and dq, dk, dv blocks must match within 1e-5 (fp32). Small tiles (block_size=3) make
the kernels cut, skip and mask tiles at odd places; one case runs the default tile size.
"""
import pytest

from tests.harness import run_dist
from tests.harness.frameworks import framework_worlds, run_on

B, S, HQ, HKV, D = 2, 16, 4, 2, 4
TOL = {"atol": 1e-5, "rtol": 1e-5}
MODES = {
    "ulysses": {},
    "allgather": {"ulysses_degree": 1},
    "allgather_lb": {"ulysses_degree": 1, "load_balance": True},
    "ring": {"ulysses_degree": 1, "kv_exchange": "ring"},
    "zigzag": {"ulysses_degree": 1, "kv_exchange": "ring", "load_balance": True},
    "hybrid": {"ulysses_degree": 2},
    "hybrid_ring": {"ulysses_degree": 2, "kv_exchange": "ring"},
}
# name -> (documents: None / "ids" / "cu", padding, causal)
CASES = {
    "padding": (None, True, False),
    "padding_causal": (None, True, True),     # left padding + causal: rows that see no key at all
    "packed": ("ids", False, False),
    "packed_causal": ("ids", False, True),
    "packed_cu_padding_causal": ("cu", True, True),
}
LENGTHS = [[3, 6, 1, 6], [9, 2, 5]]   # documents of each batch row (sum S)


def _masks():
    import torch
    ids = torch.tensor([[d for d, n in enumerate(row) for _ in range(n)] for row in LENGTHS])
    bounds = [0]
    for row in LENGTHS:
        for n in row:
            bounds.append(bounds[-1] + n)
    padding = torch.ones(B, S, dtype=torch.bool)
    padding[0, :5] = False     # left padding
    padding[1, 12:] = False    # right padding
    return ids, torch.tensor(bounds), padding


def _dense(ids, padding, documents, pad, causal):
    import torch
    allowed = torch.ones(B, S, S, dtype=torch.bool)
    if documents:
        allowed &= ids.unsqueeze(-1) == ids.unsqueeze(-2)
    if pad:
        allowed &= padding.unsqueeze(-2)
    if causal:
        allowed &= torch.ones(S, S, dtype=torch.bool).tril()
    return allowed.unsqueeze(1)


def _leaf(t):
    return t.detach().clone().requires_grad_(True)


def _check(mesh, mode, case, layout="bshd", block_size=3, seed=0, hkv=HKV):
    import torch
    import torch.nn.functional as F
    from hyper_parallel import ContextParallel, attention_masks
    from tests.frameworks.torch_adapter import TorchAdapter

    documents, pad, causal = CASES[case]
    seq, head = (1, 2) if layout == "bshd" else (2, 1)
    gen = torch.Generator().manual_seed(seed)
    full = [torch.randn(B, h, S, D, generator=gen) for h in (HQ, hkv, hkv)]
    w = torch.randn(B, HQ, S, D, generator=gen)
    ids, bounds, padding = _masks()
    refs = [_leaf(t) for t in full]
    ref = F.scaled_dot_product_attention(*refs, attn_mask=_dense(ids, padding, documents, pad, causal),
                                         enable_gqa=True)
    (ref * w).sum().backward()
    if layout == "bshd":
        full, w, ref = [t.transpose(1, 2) for t in full], w.transpose(1, 2), ref.transpose(1, 2)
        grads = [r.grad.transpose(1, 2) for r in refs]
    else:
        grads = [r.grad for r in refs]

    index, parts = mesh.get_local_rank(), mesh.size()
    leaves = [_leaf(t.chunk(parts, seq)[index]) for t in full]
    module = ContextParallel(seq_dim=seq, head_dim=head, **MODES[mode]).apply(
        TorchAdapter.attention("sdpa", layout), mesh)
    kwargs = {"padding_mask": padding if pad else None, "block_size": block_size}
    if documents == "ids":
        kwargs["document_ids"] = ids
    elif documents == "cu":
        kwargs["cu_seqlens"] = bounds
    with attention_masks(**kwargs):
        out = module(*leaves, causal=causal)
    where = f"{mode} {case} {layout} block={block_size} world={parts} kv_heads={hkv}"
    torch.testing.assert_close(out, ref.chunk(parts, seq)[index], **TOL, msg=lambda m: f"out {where}: {m}")
    (out * w.chunk(parts, seq)[index]).sum().backward()
    for name, leaf, g in zip("qkv", leaves, grads):
        torch.testing.assert_close(leaf.grad, g.chunk(parts, seq)[index], **TOL,
                                   msg=lambda m, n=name: f"d{n} {where}: {m}")
    return where


def _modes(world):
    return [m for m in MODES if world == 4 or not m.startswith("hybrid")]


def _all_modes_case(rank, world):
    from hyper_parallel import init_device_mesh
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    done = [_check(mesh, mode, case) for mode in _modes(world) for case in CASES]
    done += [_check(mesh, mode, "packed_cu_padding_causal", layout="bnsd", block_size=256)
             for mode in _modes(world)]
    done += [_check(mesh, mode, "packed_causal", hkv=HQ) for mode in _modes(world)]   # no GQA
    return done


@pytest.mark.parametrize("world", [2, 4])
def test_masks_every_mode(world):
    """Every mode × {padding, padding+causal, packed, packed+causal, cu_seqlens+padding+causal},
    forward and dq/dk/dv against single-device SDPA with the dense mask; GQA (4 q / 2 kv heads),
    and packed+causal with 4 kv heads too."""
    done = run_dist(world, _all_modes_case, timeout=900)
    assert [len(d) for d in done] == [len(_modes(world)) * (len(CASES) + 2)] * world


def _errors_case(rank, world):
    import torch
    from hyper_parallel import CommDebugMode, ContextParallel, attention_masks, init_device_mesh
    from tests.frameworks.torch_adapter import TorchAdapter

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    q = torch.randn(B, S // world, HQ, D)
    ids, _, padding = _masks()
    seen = []
    checks = [
        ("sdpa", {"document_ids": ids[:, :S // world]}, {}, "global sequence length"),   # a rank's block
        ("sdpa", {"padding_mask": padding}, {"mask": torch.ones(S // world, S, dtype=torch.bool)},
         "attn_mask"),
        ("matmul", {"document_ids": ids}, {}, "scaled_dot_product_attention"),
    ]
    for kind, masks, extra, text in checks:
        module = ContextParallel(seq_dim=1, head_dim=2, ulysses_degree=1).apply(
            TorchAdapter.attention(kind, "bshd"), mesh)
        with CommDebugMode() as comm, attention_masks(**masks):
            try:
                module(q, q, q, causal=True, **extra)
            except ValueError as exc:
                assert text in str(exc), (text, exc)
                seen.append(text)
            else:
                raise AssertionError(f"no ValueError for {kind} {list(masks)}")
        comm.get_comm_counts()
    bads = ({"document_ids": ids, "cu_seqlens": torch.tensor([0, S])},
            {"cu_seqlens": torch.tensor([0, 5, 3])}, {"document_ids": ids[0]}, {"block_size": 0})
    for bad in bads:
        try:
            with attention_masks(**bad):
                pass
        except ValueError:
            seen.append(str(sorted(bad)))
        else:
            raise AssertionError(f"no ValueError for attention_masks({sorted(bad)})")
    return seen


def test_mask_errors():
    """Masks of a rank's block instead of the whole sequence, an explicit attn_mask beside them,
    attention code other than SDPA, and malformed arguments: ValueError on every rank."""
    seen = run_dist(2, _errors_case, timeout=300)
    assert seen[0] == seen[1] and len(seen[0]) == 7


# ============================================================================ flex_attention
def _flex_case(rank, world):
    import torch
    from torch import nn
    from torch.nn.attention.flex_attention import flex_attention
    from hyper_parallel import ContextParallel, init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    compiled = torch.compile(flex_attention)

    class Flex(nn.Module):
        def __init__(self, fn):
            super().__init__()
            self.fn = fn

        def forward(self, q, k, v):
            return self.fn(*(x.transpose(1, 2) for x in (q, k, v))).transpose(1, 2)

    seen = []
    for fn_name, fn in (("eager", flex_attention), ("compiled", compiled)):
        for mode in ("ulysses", "allgather", "ring"):
            module = ContextParallel(seq_dim=1, head_dim=2, **MODES[mode]).apply(Flex(fn), mesh)
            q = torch.randn(B, S // world, HQ, D)
            try:
                module(q, q, q)
            except ValueError as exc:
                assert "scaled_dot_product_attention" in str(exc), (fn_name, mode, exc)
                seen.append((fn_name, mode))
            else:
                raise AssertionError(f"flex_attention ({fn_name}) under {mode}: no ValueError")
    return seen


def test_flex_attention_clear_error():
    """FlexAttention (eager, and torch.compile'd as torchtitan uses it) under ContextParallel: a
    ValueError naming the supported kernels instead of a TorchDynamo failure deep in tracing."""
    seen = run_dist(2, _flex_case, timeout=600)
    assert seen[0] == seen[1] and len(seen[0]) == 6


# ============================================================================ both frameworks
@pytest.mark.timeout(1500)
@pytest.mark.parametrize("framework,world", framework_worlds(2, mindspore=(2,)))
def test_masks_on_both_frameworks(framework, world):
    """Ulysses, all-gather ± load balance, ring ± zigzag × {padding, packed, packed+causal} with
    the framework-neutral case (tests/cases/cp_masks.py): torch and MindSpore ranks."""
    from tests.cases import cp_masks
    done = run_on(framework, world, cp_masks.every_mode, timeout=1400)
    assert [len(d) for d in done] == [len(cp_masks.MODES) * len(cp_masks.CASES)] * world
