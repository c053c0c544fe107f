"""The gated delta rule under context parallelism (SPEC §13) equals the single-device rule.

Reference: transformers' own torch implementations on the whole sequence (Gated DeltaNet:
torch_chunk_gated_delta_rule, per-head decay, GQA value heads; Kimi Delta Attention:
chunk_kimi_delta_attention, per-channel decay), which hyper_parallel's single-device rule equals
(forward and gradients, one process); the distributed tests compare against the latter, so the
workers need not import transformers. Each rank runs its contiguous block through
``context_parallel_delta_rule``; forward and the gradients of q, k, v, g, beta and the initial
state match to fp32 1e-5, both modes, cp 2 and 4, blocks that are not a multiple of the chunk.
gradcheck (fp64) checks the backward is the derivative of the forward (global-function pattern of
tests/test_cp_gradcheck.py).
"""
import pytest

from tests.harness import run_dist

TOL = {"atol": 1e-5, "rtol": 1e-5}


def _inputs(kind, b, t, dtype, seed=3):
    import torch
    gen = torch.Generator().manual_seed(seed)
    h_k, h_v, d_k, d_v = (2, 4, 4, 3) if kind == "gdn" else (3, 3, 4, 4)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=dtype)
    gate_shape = (b, t, h_v) if kind == "gdn" else (b, t, h_v, d_k)
    q, k, v = rnd(b, t, h_k, d_k), rnd(b, t, h_k, d_k), rnd(b, t, h_v, d_v)
    g = -torch.rand(*gate_shape, generator=gen, dtype=dtype) * 0.5
    beta = torch.rand(b, t, h_v, generator=gen, dtype=dtype)
    return [q, k, v, g, beta, rnd(b, h_v, d_k, d_v)]


def _transformers_rule(kind):
    if kind == "gdn":
        from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule as rule
    else:
        from transformers.models.kimi_linear.modeling_kimi_linear import chunk_kimi_delta_attention as rule
    return rule


def _reference(kind, inputs, chunk, rule=None):
    """The single-device rule on the whole sequence: hyper_parallel's own (the distributed tests; it
    equals transformers', test_single_device_rule_is_transformers) or ``rule`` (transformers')."""
    from hyper_parallel.core.context_parallel.linear_attention import chunk_delta_rule
    q, k, v, g, beta, h0 = inputs
    if rule is None:
        return chunk_delta_rule(q, k, v, g, beta, initial_state=h0, chunk_size=chunk)[0]
    out, _ = rule(q, k, v, g=g, beta=beta, chunk_size=chunk, initial_state=h0, use_qk_l2norm_in_kernel=True)
    return out


@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_single_device_rule_is_transformers(kind):
    """hyper_parallel's chunked rule (forward, every gradient) equals transformers' torch implementation."""
    import torch
    pytest.importorskip("transformers")
    ours = [x.requires_grad_() for x in _inputs(kind, 2, 22, torch.float32)]
    theirs = [x.detach().clone().requires_grad_() for x in ours]
    weight = torch.randn(2, 22, ours[2].shape[2], ours[2].shape[3], generator=torch.Generator().manual_seed(5))
    outs = [_reference(kind, ours, 4), _reference(kind, theirs, 4, _transformers_rule(kind))]
    torch.testing.assert_close(outs[0], outs[1], **TOL)
    for out in outs:
        (out * weight).sum().backward()
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.grad, b.grad, **TOL)


def _exact(rank, world_size, cases):
    import torch
    from hyper_parallel import init_device_mesh
    from hyper_parallel.core.context_parallel.linear_attention import context_parallel_delta_rule
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
    for kind, mode, t, chunk in cases:
        full = [x.requires_grad_() for x in _inputs(kind, 2, t, torch.float32)]
        out = _reference(kind, full, chunk)
        weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(5))
        (out * weight).sum().backward()
        lo, hi = rank * t // world_size, (rank + 1) * t // world_size
        mine = [x.detach()[:, lo:hi].clone().requires_grad_() for x in full[:5]]
        h0 = full[5].detach().clone().requires_grad_()
        block = context_parallel_delta_rule(*mine, mesh, mode=mode, initial_state=h0, chunk_size=chunk)
        torch.testing.assert_close(block, out.detach()[:, lo:hi], **TOL)
        (block * weight[:, lo:hi]).sum().backward()
        for name, x, ref in zip("q k v g beta".split(), mine, full):
            assert x.grad.is_contiguous()
            torch.testing.assert_close(x.grad, ref.grad[:, lo:hi], **TOL, msg=lambda m: f"{kind} {mode} d{name}: {m}")
        torch.testing.assert_close(h0.grad, full[5].grad, **TOL)
    return len(cases)


CASES = [(kind, mode, 22, 4) for kind in ("gdn", "kda") for mode in ("allgather", "p2p")]


@pytest.mark.parametrize("world_size", [2, 4], ids=["cp2", "cp4"])
def test_delta_rule_exact(world_size):
    assert run_dist(world_size, _exact, CASES) == [len(CASES)] * world_size


def _gradcheck(rank, world_size, cases):
    import torch
    from hyper_parallel import DTensor, Replicate, Shard, init_device_mesh
    from hyper_parallel.core.context_parallel.linear_attention import context_parallel_delta_rule
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
    for kind, mode in cases:
        def rule(q, k, v, g, beta, h0):
            blocks = [DTensor.from_local(x, mesh, [Replicate()]).redistribute(mesh, [Shard(1)]).to_local()
                      for x in (q, k, v, g, beta)]
            out = context_parallel_delta_rule(*blocks, mesh, mode=mode, initial_state=h0, chunk_size=2)
            return DTensor.from_local(out, mesh, [Shard(1)]).full_tensor()
        inputs = [x.requires_grad_() for x in _inputs(kind, 1, 3 * world_size, torch.float64)]
        # fast mode (random projections of the Jacobian): the full one costs minutes on 2 cores
        assert torch.autograd.gradcheck(rule, inputs, eps=1e-6, atol=1e-6, rtol=1e-5, fast_mode=True), (kind, mode)
    return len(cases)


GRADCHECK = [(kind, mode) for kind in ("gdn", "kda") for mode in ("allgather", "p2p")]


@pytest.mark.parametrize("world_size", [2, 4], ids=["cp2", "cp4"])
def test_delta_rule_gradcheck(world_size):
    assert run_dist(world_size, _gradcheck, GRADCHECK, timeout=300) == [len(GRADCHECK)] * world_size


def _style(rank, world_size):
    """LinearAttentionContextParallel on a user's KDA-style layer (per-channel decay, p2p): this rank's
    output block, input gradient and the parameter gradients summed over the ranks equal one device."""
    import torch
    import torch.nn.functional as F
    from hyper_parallel import get_platform, init_device_mesh, parallelize_module, shard_sequence
    from hyper_parallel.core.context_parallel.linear_attention import (LinearAttentionContextParallel,
                                                                       causal_conv1d, delta_rule)

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv, self.gate = torch.nn.Linear(8, 24), torch.nn.Linear(8, 10)
            self.conv = torch.nn.Parameter(torch.randn(24, 3))

        def forward(self, x):
            q, k, v = F.silu(causal_conv1d(self.qkv(x).transpose(1, 2), self.conv)).transpose(1, 2).chunk(3, -1)
            g, beta = self.gate(x).split([8, 2], dim=-1)
            q, k, v = (t.unflatten(-1, (2, 4)) for t in (q, k, v))
            return delta_rule(q, k, v, F.logsigmoid(g).unflatten(-1, (2, 4)), beta.sigmoid(), chunk_size=4)

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
    with pytest.raises(ValueError, match="mode='ring'"):
        LinearAttentionContextParallel(mode="ring")
    torch.manual_seed(0)
    layer = Layer()
    x = torch.randn(2, 6 * world_size, 8, requires_grad=True)
    expected = layer(x)
    expected.pow(2).sum().backward()
    ref_grads = [p.grad.clone() for p in layer.parameters()]
    layer.zero_grad()
    parallelize_module(layer, mesh, LinearAttentionContextParallel(mode="p2p"))
    block = shard_sequence(x.detach(), mesh).requires_grad_()
    out = layer(block)
    torch.testing.assert_close(out, shard_sequence(expected.detach(), mesh), **TOL)
    out.pow(2).sum().backward()
    torch.testing.assert_close(block.grad, shard_sequence(x.grad, mesh), **TOL)
    for p, ref in zip(layer.parameters(), ref_grads):
        torch.testing.assert_close(get_platform().all_reduce(p.grad, mesh.get_group()), ref, **TOL)
    return True


def test_style_on_a_users_layer():
    assert run_dist(2, _style) == [True] * 2
