"""tiled_mlp: a Llama MLP run on sequence tiles with recompute gives the same output and the same
input / parameter gradients as the plain MLP; its tiles' intermediates are recomputed, not kept."""
import pytest
import torch

from hyper_parallel import tiled_mlp

pytest.importorskip("transformers")
TOL = dict(rtol=1e-5, atol=1e-5)


def _mlp():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP
    torch.manual_seed(0)
    return LlamaMLP(LlamaConfig(hidden_size=16, intermediate_size=48, num_attention_heads=4))


def _run(mlp, x):
    x = x.clone().requires_grad_()
    out = mlp(x)
    (out * torch.linspace(-1, 1, out.numel()).reshape(out.shape)).sum().backward()
    return out.detach(), x.grad, {n: p.grad for n, p in mlp.named_parameters()}


@pytest.mark.parametrize("chunks, seq", [(1, 12), (4, 12), (5, 12), (16, 12), (3, 1)])
def test_tiled_mlp_is_exact(chunks, seq):
    x = torch.randn(2, seq, 16, generator=torch.Generator().manual_seed(1))
    want = _run(_mlp(), x)
    got = _run(tiled_mlp(_mlp(), chunks), x)
    torch.testing.assert_close(got[0], want[0], **TOL)
    torch.testing.assert_close(got[1], want[1], **TOL)
    for name in want[2]:
        torch.testing.assert_close(got[2][name], want[2][name], **TOL)


def test_tiles_keep_only_their_inputs_for_backward():
    saved = []
    x = torch.randn(1, 64, 16, requires_grad=True)
    for mlp in (_mlp(), tiled_mlp(_mlp(), 8)):
        sizes = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: sizes.append(t.numel()) or t, lambda t: t):
            mlp(x).sum().backward()
        saved.append(sum(sizes))
    # plain: the (64 x 48) gate / up / product activations and more; tiled: the 8 tile inputs (64 x 16)
    assert saved[1] < saved[0] / 2, saved


def test_tiled_mlp_other_seq_dim_and_no_grad():
    x = torch.randn(12, 2, 16)
    plain, tiled = _mlp(), tiled_mlp(_mlp(), 3, seq_dim=0)
    with torch.no_grad():
        torch.testing.assert_close(tiled(x), plain(x), **TOL)


@pytest.mark.parametrize("chunks", [0, 1.5, True])
def test_bad_chunks_name_the_value(chunks):
    with pytest.raises(ValueError, match=f"chunks={chunks!r}"):
        tiled_mlp(_mlp(), chunks)


def test_applied_twice_refused():
    mlp = tiled_mlp(_mlp(), 2)
    with pytest.raises(ValueError, match="already tiled"):
        tiled_mlp(mlp, 2)
