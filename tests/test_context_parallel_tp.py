"""ContextParallel composed with tensor parallelism: q/k/v arrive head-sharded on a "tp" mesh."""
import pytest

from tests.cases import context_parallel as neutral
from tests.harness import run_dist
from tests.harness.frameworks import FRAMEWORKS, run_on
from tests.test_context_parallel import AG, LB, UL, B, _block, _close, _leaf, _sum_over_ranks


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_tp_cp_composition(framework):
    """q/k/v head-sharded on mesh["tp"], ContextParallel on mesh["cp"], every non-hybrid mode, both
    layouts and kernels, on torch and MindSpore (tests/cases/context_parallel.py)."""
    done = run_on(framework, 4, neutral.tp_cp, timeout=280)
    assert [len(d) for d in done] == [12] * 4


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
