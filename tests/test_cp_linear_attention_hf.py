"""parallelize_model on the hybrid linear-attention families (SPEC §13): Qwen3-Next and Qwen3.5 (Gated
DeltaNet + full attention; Qwen3-Next with MoE) and Kimi-Linear (KDA + MLA, MoE) train equal to one
process under context parallelism — two AdamW steps, per-step loss and every weight, fp32 1e-5 —
with the linear layers' state passed by all-gather or P2P, and with the full-attention layers
head-tail balanced in the same model (the linear layers keep the contiguous blocks)."""
import pytest

from tests.harness import run_dist

pytest.importorskip("transformers")

MODES = {"allgather": {}, "p2p": {"linear_attention": "p2p"},
         "allgather-lb": {"ulysses_degree": 1, "load_balance": True}}


def _exact(rank, world_size, family, modes):
    from tests.test_hf_model_zoo import trains_like_one_process
    return trains_like_one_process(family, {}, [(m, MODES[m]) for m in modes])


@pytest.mark.parametrize("family,modes", [
    ("qwen3_next", ["allgather", "p2p"]),
    ("qwen3_5", ["allgather-lb"]),
    ("kimi_linear", ["allgather", "p2p"]),
])
def test_linear_attention_family_trains_like_one_process(family, modes):
    assert run_dist(2, _exact, family, modes, timeout=300) == [True] * 2


def _refusals(rank, world_size):
    """The audit still measures everything else: a convolution nobody made exact, added to a GDN model,
    is refused by name; an unknown state mode, and linear attention under CP together with TP, are
    refused before any collective."""
    import torch
    from hyper_parallel import init_device_mesh
    from hyper_parallel.integrations.transformers import parallelize_model
    from tests.hf_zoo import tiny

    class ConvThenMLP(torch.nn.Module):
        def __init__(self, mlp, hidden):
            super().__init__()
            self.mlp, self.conv = mlp, torch.nn.Conv1d(hidden, hidden, 3, padding=2, groups=hidden)

        def forward(self, x):
            return self.mlp(self.conv(x.transpose(1, 2))[..., :x.shape[1]].transpose(1, 2))

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
    model = tiny("qwen3_5")
    layer = model.model.layers[0]
    layer.mlp = ConvThenMLP(layer.mlp, model.config.hidden_size)
    with pytest.raises(ValueError, match=r"layers\.0\.mlp \(ConvThenMLP: a convolution"):
        parallelize_model(model, mesh)
    with pytest.raises(ValueError, match=r"linear_attention='ring'"):
        parallelize_model(tiny("qwen3_5"), mesh, linear_attention="ring")
    cp_tp = init_device_mesh("cpu", (world_size, 1), mesh_dim_names=("cp", "tp"))
    with pytest.raises(ValueError, match="not together with tensor parallelism"):
        parallelize_model(tiny("qwen3_5"), cp_tp)
    return True


def test_audit_still_refuses_other_mixing():
    assert run_dist(2, _refusals) == [True] * 2


def _padded(rank, world_size, family):
    """A right-padded batch (2-D attention_mask): the linear layers zero the padded tokens of their
    block as one device does over the whole sequence; logits of the kept tokens and every gradient
    match one process."""
    import torch
    from hyper_parallel import get_platform, init_device_mesh, shard_sequence
    from hyper_parallel.integrations.transformers import parallelize_model
    from tests.hf_zoo import VOCAB, tiny

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[1, 11:] = 0
    reference, model = tiny(family), tiny(family)
    ref = reference(input_ids=ids, attention_mask=mask).logits * mask[..., None]
    ref.square().sum().backward()
    parallelize_model(model, mesh)
    ids_block, mask_block = shard_sequence([ids, mask], mesh)
    out = model(input_ids=ids_block, attention_mask=mask_block).logits * mask_block[..., None]
    torch.testing.assert_close(out, shard_sequence(ref.detach(), mesh), atol=1e-5, rtol=1e-5)
    out.square().sum().backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        grad = get_platform().all_reduce(p.grad, mesh.get_group())
        torch.testing.assert_close(grad, q.grad, atol=1e-5, rtol=1e-5, msg=lambda m: f"{family} {name}: {m}")
    return True


def test_padding_mask_matches_one_process():
    assert run_dist(2, _padded, "qwen3_5") == [True] * 2
