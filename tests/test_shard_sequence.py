"""shard_sequence: the blocks ContextParallel expects (contiguous; with load_balance=True as well,
the head-tail exchange being internal to the style), checked end to end against single-device
causal attention, plus structures and errors."""
import pytest

from tests.harness import run_dist

B, S, H, D = 2, 16, 4, 8


def _attention_module(torch):
    import torch.nn.functional as F

    class Core(torch.nn.Module):
        def forward(self, q, k, v):  # BSHD
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
            return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
    return Core()


def _cp_end_to_end(rank, world_size):
    import torch
    from hyper_parallel import ContextParallel, init_device_mesh, shard_sequence

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(B, S, H, D, generator=g) for _ in range(3))
    weights = torch.randn(B, S, H, D, generator=g)
    ref_qkv = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_out = _attention_module(torch)(*ref_qkv)
    (ref_out * weights).sum().backward()
    styles = {"ulysses": dict(), "allgather": dict(ulysses_degree=1),
              "allgather-lb": dict(ulysses_degree=1, load_balance=True),
              "ring-zigzag": dict(ulysses_degree=1, load_balance=True, kv_exchange="ring")}
    for name, kwargs in styles.items():
        lb = kwargs.get("load_balance", False)
        attn = ContextParallel(seq_dim=1, head_dim=2, **kwargs).apply(_attention_module(torch), mesh)
        local = [t.requires_grad_() for t in shard_sequence([q, k, v], mesh, load_balance=lb)]
        out = attn(*local)
        (out * shard_sequence(weights, mesh, load_balance=lb)).sum().backward()
        torch.testing.assert_close(out, shard_sequence(ref_out.detach(), mesh), atol=1e-5, rtol=1e-5,
                                   msg=lambda m: f"{name} out: {m}")
        for t, ref in zip(local, ref_qkv):
            torch.testing.assert_close(t.grad, shard_sequence(ref.grad, mesh), atol=1e-5, rtol=1e-5,
                                       msg=lambda m: f"{name} grad: {m}")
    # the head-tail chunks (2r, 2P-1-2r) themselves are NOT what the style takes: it balances internally
    attn = ContextParallel(seq_dim=1, head_dim=2, ulysses_degree=1, load_balance=True).apply(
        _attention_module(torch), mesh)
    chunks = [t.chunk(2 * world_size, 1) for t in (q, k, v)]
    head_tail = [torch.cat([c[2 * rank], c[2 * world_size - 1 - 2 * rank]], 1) for c in chunks]
    ref_chunks = ref_out.detach().chunk(2 * world_size, 1)
    expected = torch.cat([ref_chunks[2 * rank], ref_chunks[2 * world_size - 1 - 2 * rank]], 1)
    assert not torch.allclose(attn(*head_tail), expected, atol=1e-3)
    return True


def test_shard_sequence_matches_context_parallel_in_every_layout():
    assert run_dist(4, _cp_end_to_end) == [True] * 4


def _structures_and_errors(rank, world_size):
    import collections

    import torch
    from hyper_parallel import init_device_mesh, shard_sequence

    root = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    mesh = root["cp"]
    r = mesh.get_local_rank()
    ids = torch.arange(2 * 8).reshape(2, 8)
    labels = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], 1)  # shifted globally first
    got = shard_sequence(ids, mesh)
    assert got.is_contiguous() and torch.equal(got, ids[:, 4 * r:4 * r + 4])
    pair = shard_sequence((ids, labels), mesh)
    assert isinstance(pair, tuple) and torch.equal(pair[1], labels[:, 4 * r:4 * r + 4])
    Batch = collections.namedtuple("Batch", "ids labels")
    nt = shard_sequence(Batch(ids, None), mesh)
    assert isinstance(nt, Batch) and nt.labels is None
    as_list = shard_sequence([ids.T], mesh, seq_dim=0)
    assert isinstance(as_list, list) and torch.equal(as_list[0], ids.T[4 * r:4 * r + 4])
    assert torch.equal(shard_sequence(ids, mesh, seq_dim=-1, load_balance=True), got)
    with pytest.raises(ValueError, match="not divisible by 2 x"):
        shard_sequence(ids[:, :6], mesh, load_balance=True)
    with pytest.raises(ValueError, match="not divisible by the mesh size"):
        shard_sequence(ids[:, :7], mesh)
    with pytest.raises(ValueError, match="out of range"):
        shard_sequence(ids, mesh, seq_dim=2)
    with pytest.raises(ValueError, match="1-D"):
        shard_sequence(ids, root)
    return True


def test_shard_sequence_structures_and_errors():
    assert run_dist(4, _structures_and_errors) == [True] * 4
