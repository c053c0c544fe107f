"""ContextParallel composed with tensor parallelism: q/k/v arrive head-sharded on a "tp" mesh."""
from tests.harness import run_dist
from tests.test_context_parallel import (AG, LAYOUTS, LB, UL, B, _attention_module, _block, _close, _leaf,
                                         _qkv, _sum_over_ranks)


def _tp_cp_case(rank, world):
    """Root mesh ("cp", "tp") = (2, 2). q/k/v arrive as DTensors on mesh["tp"] with Shard(head)
    whose global sequence is this CP rank's block; ContextParallel runs on mesh["cp"] and the
    output comes back on mesh["tp"] with the same placements."""
    from hyper_parallel import ContextParallel, DTensor, Shard, init_device_mesh

    root = init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp", "tp"))
    cp_mesh, tp_mesh = root["cp"], root["tp"]
    c, t = cp_mesh.get_local_rank(), tp_mesh.get_local_rank()
    S, H = 16, 8
    for layout in LAYOUTS:
        seq, head = LAYOUTS[layout]
        for mode in (UL, AG, LB):
            for kind, causal in (("sdpa", True), ("matmul", False)):
                full_q, full_k, full_v, w = _qkv(layout, S, H)
                ref_leaves = [_leaf(x) for x in (full_q, full_k, full_v)]
                ref = _attention_module(kind, layout)(*ref_leaves, causal=causal)
                (ref * w).sum().backward()

                def mine(x):
                    return _block(_block(x, seq, c, 2), head, t, 2)

                leaves = [_leaf(mine(x)) for x in (full_q, full_k, full_v)]
                dts = [DTensor.from_local(x, tp_mesh, [Shard(head)]) for x in leaves]
                module = ContextParallel(seq_dim=seq, head_dim=head, **mode).apply(
                    _attention_module(kind, layout), cp_mesh)
                out = module(*dts, causal=causal)
                what = f"TPxCP {layout} {mode} {kind} causal={causal}"
                assert isinstance(out, DTensor), what
                assert out.device_mesh == tp_mesh and tuple(out.placements) == (Shard(head),), \
                    (what, out.device_mesh, out.placements)
                _close(out.to_local(), mine(ref), f"out {what}")
                (out.to_local() * mine(w)).sum().backward()
                for name, leaf, ref_leaf in zip("qkv", leaves, ref_leaves):
                    _close(leaf.grad, mine(ref_leaf.grad), f"d{name} {what}")
    return True


def test_tp_cp_composition():
    assert run_dist(4, _tp_cp_case, timeout=600) == [True] * 4


def _llama_attention(dim, heads, head_dim):
    """The attention layer of docs/context_parallel.md's TP × CP example (BSHD, causal sdpa)."""
    import torch.nn as nn
    import torch.nn.functional as F

    class CoreAttention(nn.Module):
        def forward(self, q, k, v):
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
            return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.wq = nn.Linear(dim, heads * head_dim, bias=False)
            self.wk = nn.Linear(dim, heads * head_dim, bias=False)
            self.wv = nn.Linear(dim, heads * head_dim, bias=False)
            self.wo = nn.Linear(heads * head_dim, dim, bias=False)
            self.core = CoreAttention()

        def forward(self, x):
            b, s, _ = x.shape
            q = self.wq(x).view(b, s, -1, head_dim)
            k = self.wk(x).view(b, s, -1, head_dim)
            v = self.wv(x).view(b, s, -1, head_dim)
            return self.wo(self.core(q, k, v).reshape(b, s, -1))

    return Attention()


def _llama_tp_cp_case(rank, world):
    """TP (Colwise q/k/v, Rowwise o) on mesh["tp"] and ContextParallel on the core attention on
    mesh["cp"], as in the docs: output, input gradient and projection-weight gradients (summed over
    the CP ranks, as a data-parallel gradient reduction would) equal the unparallelized layer's."""
    import copy

    import torch
    from hyper_parallel import (ColwiseParallel, ContextParallel, DTensor, RowwiseParallel, init_device_mesh,
                                parallelize_module)

    dim, heads, head_dim, S = 16, 4, 4, 16
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp", "tp"))
    c = mesh["cp"].get_local_rank()
    cp_group = mesh["cp"].get_group()  # the process group over this rank's CP peers
    for mode in (UL, AG, LB):
        torch.manual_seed(3)
        ref_layer = _llama_attention(dim, heads, head_dim)
        layer = copy.deepcopy(ref_layer)
        x = torch.randn(B, S, dim, generator=torch.Generator().manual_seed(4))
        w = torch.randn(B, S, dim, generator=torch.Generator().manual_seed(5))
        x_ref = _leaf(x)
        ref = ref_layer(x_ref)
        (ref * w).sum().backward()

        parallelize_module(layer, mesh["tp"], {"w[qkv]": ColwiseParallel(use_local_output=False),
                                               "wo": RowwiseParallel()})
        parallelize_module(layer.core, mesh["cp"], ContextParallel(seq_dim=1, head_dim=2, **mode))
        x_local = _leaf(_block(x, 1, c, 2))
        out = layer(x_local)
        what = f"TPxCP layer {mode}"
        assert not isinstance(out, DTensor), what
        _close(out, _block(ref, 1, c, 2), f"out {what}")
        (out * _block(w, 1, c, 2)).sum().backward()
        _close(x_local.grad, _block(x_ref.grad, 1, c, 2), f"dx {what}")
        for name in ("wq", "wk", "wv", "wo"):
            grad = getattr(layer, name).weight.grad
            assert isinstance(grad, DTensor) and grad.device_mesh == mesh["tp"], (name, type(grad))
            full = grad.full_tensor()
            _close(_sum_over_ranks(full, cp_group), getattr(ref_layer, name).weight.grad, f"d{name} {what}")
    return True


def test_tp_cp_llama_attention_layer():
    assert run_dist(4, _llama_tp_cp_case, timeout=600) == [True] * 4


# ============================================================================ communication volume
