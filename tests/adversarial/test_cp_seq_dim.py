"""ContextParallel told a seq_dim that is not q/k/v's sequence, with sizes where the shapes cannot tell
(B·P == S_local == heads): the sequence dim is followed through the module's relayouts to the
attention kernel (core/attention/roles.py), so every mode either equals one process (forward and the
gradients of q, k, v) or raises a ValueError naming seq_dim and the fix on every rank.

Table: mode x (layout, seq_dim, head_dim) x kernel entry (a transpose then sdpa; a permute and
a reshape round trip; a scale; hyper_parallel.attention), plus masked modes under attention_masks.
Before the tracking, Ulysses, ring and zigzag with seq_dim=0 on BSHD blocks were silently wrong
(forward and dK/dV). A collective after each error shows the ranks are still in step."""
from tests.harness import run_dist

B, P, S, H, D = 2, 2, 8, 4, 4          # S_local = 4 = B·P = H: no shape tells the dims apart
TOL = {"atol": 1e-5, "rtol": 1e-5}
UL, AG = {}, {"ulysses_degree": 1}
LB = {"ulysses_degree": 1, "load_balance": True}
RING = {"ulysses_degree": 1, "kv_exchange": "ring"}
ZIGZAG = {"ulysses_degree": 1, "load_balance": True, "kv_exchange": "ring"}
# mode -> (style, kernel entries, also under attention_masks)
MODES_2 = {"ulysses": (UL, ("sdpa", "permute", "scale", "variant"), True),
           "allgather": (AG, ("sdpa", "variant"), True),
           "load_balance": (LB, ("sdpa",), False), "ring": (RING, ("permute",), True),
           "zigzag": (ZIGZAG, ("sdpa",), False)}
MODES_4 = {"hybrid": ({"ulysses_degree": 2}, ("sdpa",), False),
           "hybrid_ring": ({"ulysses_degree": 2, "kv_exchange": "ring"}, ("sdpa",), False)}
# (layout, seq_dim, head_dim, right?)
DIMS = [("bshd", 1, 2, True), ("bshd", 0, 2, False), ("bnsd", 1, 2, False), ("bnsd", 2, 1, True),
        ("bnsd", 0, 1, False)]
SHORT = DIMS[:4]   # for the modes checked with one kernel entry


def _module(layout, entry):
    import torch
    import torch.nn.functional as F
    import hyper_parallel as hp

    class Attention(torch.nn.Module):
        def forward(self, q, k, v):
            if entry == "permute":   # a longer relayout path to the kernel
                q, k, v = (t.permute(0, 2, 1, 3) if layout == "bshd" else t for t in (q, k, v))
                q = q.reshape(q.shape[0], q.shape[1], -1).view(q.shape).contiguous()
            elif layout == "bshd":
                q, k, v = (t.transpose(1, 2) for t in (q, k, v))
            if entry == "scale":   # same-shape elementwise ops keep the tracked dim
                q = q * 1.0 + 0.0
            if entry == "variant":
                out = hp.attention(q, k, v, is_causal=True)
            else:
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return out.transpose(1, 2) if layout == "bshd" else out
    return Attention()


def _reference(torch, full, layout, mask=None):
    import torch.nn.functional as F
    bnsd = [t.transpose(1, 2) if layout == "bshd" else t for t in full]
    out = F.scaled_dot_product_attention(*bnsd, attn_mask=mask, is_causal=mask is None)
    return out.transpose(1, 2) if layout == "bshd" else out


def _one(rank, world, mesh, style, layout, seq_dim, head_dim, right, entry, masks=None):
    """One case: exact vs one process, or a ValueError naming seq_dim; returns a short tag."""
    import torch
    from hyper_parallel import ContextParallel, attention_masks
    gen = torch.Generator().manual_seed(seq_dim * 10 + head_dim)
    shape = (B, S, H, D) if layout == "bshd" else (B, H, S, D)
    full = [torch.randn(shape, generator=gen) for _ in range(3)]
    seq = 1 if layout == "bshd" else 2
    leaves = [t.chunk(world, seq)[rank].clone().requires_grad_(True) for t in full]
    cp = ContextParallel(seq_dim=seq_dim, head_dim=head_dim, **style).apply(_module(layout, entry), mesh)
    ctx = attention_masks(document_ids=masks) if masks is not None else _nothing()
    try:
        with ctx:
            out = cp(*leaves)
    except ValueError as exc:
        message = str(exc)
        assert not right, f"right dims refused: {message}"
        assert f"seq_dim={seq_dim}" in message and "seq_dim=1, head_dim=2" in message, message
        if layout == "bshd" and masks is None:   # what seq_dim=0 reached: the batch
            assert "batch dim 0" in message, message
        return "refused"
    assert right, f"seq_dim={seq_dim}, head_dim={head_dim} on {layout} accepted (silent)"
    grad_full = torch.randn(shape, generator=gen)
    (out * grad_full.chunk(world, seq)[rank]).sum().backward()
    ref_leaves = [t.clone().requires_grad_(True) for t in full]
    want = _reference(torch, ref_leaves, layout, _doc_mask(torch, masks))
    (want * grad_full).sum().backward()
    torch.testing.assert_close(out, want.chunk(world, seq)[rank], **TOL)
    for name, got, ref in zip("qkv", leaves, ref_leaves):
        torch.testing.assert_close(got.grad, ref.grad.chunk(world, seq)[rank], **TOL,
                                   msg=lambda m, name=name: f"d{name}: {m}")
    return "exact"


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _doc_mask(torch, doc):
    """The global (B, 1, S, S) mask of causal attention within documents ``doc`` (B, S)."""
    if doc is None:
        return None
    same = doc[:, :, None] == doc[:, None, :]
    return (same & torch.ones(S, S, dtype=torch.bool).tril())[:, None]


def _table(rank, world, modes):
    import torch
    from hyper_parallel import init_device_mesh
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",), timeout=20)
    docs = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 1, 1, 2]])
    results = {}
    for mode, (style, entries, masked) in modes.items():
        for layout, seq_dim, head_dim, right in (DIMS if len(entries) > 1 else SHORT):
            for entry in entries:
                tag = (mode, layout, seq_dim, entry)
                results[tag] = _one(rank, world, mesh, style, layout, seq_dim, head_dim, right, entry)
            if masked:
                tag = (mode, layout, seq_dim, "masked")
                results[tag] = _one(rank, world, mesh, style, layout, seq_dim, head_dim, right, "sdpa", docs)
            torch.distributed.barrier()   # still in step after every refusal
    return results


def _expected(modes):
    want = {}
    for mode, (_, entries, masked) in modes.items():
        for layout, seq_dim, _, right in (DIMS if len(entries) > 1 else SHORT):
            for entry in list(entries) + (["masked"] if masked else []):
                want[(mode, layout, seq_dim, entry)] = "exact" if right else "refused"
    return want


def test_seq_dim_tracked_two_ranks():
    results = run_dist(2, _table, MODES_2)
    assert results[0] == results[1] == _expected(MODES_2)


def test_seq_dim_tracked_hybrid():
    results = run_dist(4, _table, MODES_4)
    assert all(r == _expected(MODES_4) for r in results)
