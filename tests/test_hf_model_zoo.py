"""parallelize_model across Hugging Face families: each trains equal to one process under context
parallelism (two AdamW steps: per-step loss, every weight) or is refused with a ValueError on every
rank before any step — never a different model in silence. Gemma 2's soft-capping, gpt-oss's sinks
and sliding windows shorter than the sequence train exactly in every mode (the linear-attention
families: tests/test_cp_linear_attention_hf.py); what a mode cannot split (DeepSeek-V3.2's sparse
attention outside the all-gather mode: tests/test_cp_mla.py) must be refused; a convolution over the sequence that nobody listed is found by
measurement, and a kernel-1 one (token-local) is not refused."""
import pytest

from tests.harness import run_dist

pytest.importorskip("transformers")

B, S = 2, 16


def _conv_model(kernel):
    """A Llama whose first MLP sees a depthwise convolution over the sequence first."""
    import torch
    from tests.hf_zoo import tiny

    class ConvThenMLP(torch.nn.Module):
        def __init__(self, mlp, hidden):
            super().__init__()
            self.mlp = mlp
            self.conv = torch.nn.Conv1d(hidden, hidden, kernel, padding=kernel - 1, groups=hidden)

        def forward(self, x):
            mixed = self.conv(x.transpose(1, 2))[..., :x.shape[1]].transpose(1, 2)
            return self.mlp(mixed)

    model = tiny("llama")
    layer = model.model.layers[0]
    layer.mlp = ConvThenMLP(layer.mlp, model.config.hidden_size)
    return model


def _refused(rank, world_size):
    from hyper_parallel import init_device_mesh
    from hyper_parallel.integrations.transformers import parallelize_model
    from tests.hf_zoo import tiny

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
    expected = {   # linear attention trains exactly: tests/test_cp_linear_attention_hf.py
        # DSA's top-k needs the global keys: all-gather mode only (trains exactly there: tests/test_cp_mla.py)
        "deepseek_v32": "DeepSeek Sparse Attention .* the 'ulysses' mode was requested",
    }
    for family, match in expected.items():
        with pytest.raises(ValueError, match=match):
            parallelize_model(tiny(family), mesh)
    with pytest.raises(ValueError, match=r"layers\.0\.mlp \(ConvThenMLP: a convolution"):
        parallelize_model(_conv_model(3), mesh)
    parallelize_model(_conv_model(1), mesh)   # a kernel-1 convolution is token-local
    return True


def test_unsplittable_families_are_refused_on_every_rank():
    assert run_dist(2, _refused) == [True] * 2


def _train(model, batches, cp_mesh=None):
    """Two AdamW steps; the per-step losses (each rank's share of the global mean under CP)."""
    import torch
    import torch.nn.functional as F
    from hyper_parallel import data_parallel, shard_sequence

    if cp_mesh is not None:
        data_parallel(model, cp_mesh, average=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    losses = []
    for ids, labels in batches:
        count = (labels != -100).sum()
        if cp_mesh is not None:
            ids, labels = shard_sequence([ids, labels], cp_mesh)
        logits = model(input_ids=ids).logits
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum") / count
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    return losses


def _batches():
    import torch
    from tests.hf_zoo import VOCAB
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(2):
        ids = torch.randint(0, VOCAB, (B, S), generator=g)
        out.append((ids, torch.cat([ids[:, 1:], torch.full((B, 1), -100)], 1)))
    return out


GEMMA2_CAPPED = {"attn_logit_softcapping": 0.5, "initializer_range": 1.0}
GPT_OSS_SINKS = {"initializer_range": 0.3}


def test_variants_change_the_model():
    """The zoo's soft-capping and sinks change the tiny models' outputs (else exactness proves nothing)."""
    import torch
    from tests.hf_zoo import tiny
    ids = torch.randint(0, 64, (B, S), generator=torch.Generator().manual_seed(1))
    capped = tiny("gemma2", **GEMMA2_CAPPED)(input_ids=ids).logits
    uncapped = tiny("gemma2", **dict(GEMMA2_CAPPED, attn_logit_softcapping=None))(input_ids=ids).logits
    assert (capped - uncapped).abs().max() > 1e-2
    model = tiny("gpt_oss", **GPT_OSS_SINKS)
    with_sinks = model(input_ids=ids).logits
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.fill_(-1e4)   # e^-1e4 = 0: no sink
    assert (with_sinks - model(input_ids=ids).logits).abs().max() > 1e-3


MODES = {"ulysses": {}, "allgather": {"ulysses_degree": 1},
         "allgather-lb": {"ulysses_degree": 1, "load_balance": True},
         "ring": {"ulysses_degree": 1, "kv_exchange": "ring"},
         "zigzag": {"ulysses_degree": 1, "kv_exchange": "ring", "load_balance": True}}


def trains_like_one_process(family, overrides, modes):
    """Two AdamW steps of ``family`` under ``parallelize_model(**kwargs)`` for each (name, kwargs) of
    ``modes`` on a 1-D "cp" mesh: per-step loss and every weight equal the single-process run."""
    import torch
    from hyper_parallel import get_platform, init_device_mesh
    from hyper_parallel.integrations.transformers import parallelize_model
    from tests.hf_zoo import tiny

    mesh = init_device_mesh("cpu", (get_platform().get_world_size(),), mesh_dim_names=("cp",))
    reference = tiny(family, **overrides)
    ref_losses = _train(reference, _batches())
    for mode, kwargs in modes:
        model = parallelize_model(tiny(family, **overrides), mesh, **kwargs)
        losses = _train(model, _batches(), mesh)
        for step, (loss, ref) in enumerate(zip(losses, ref_losses)):
            total = get_platform().all_reduce(loss, mesh.get_group())
            torch.testing.assert_close(total, ref, atol=1e-5, rtol=1e-5,
                                       msg=lambda m: f"{family} {mode} step {step} loss: {m}")
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p.detach(), q.detach(), atol=1e-5, rtol=1e-5,
                                       msg=lambda m: f"{family} {mode} {name}: {m}")
    return True


def _exact(rank, world_size, family, overrides, modes):
    return trains_like_one_process(family, overrides, [(m, MODES[m]) for m in modes])


@pytest.mark.parametrize("family,overrides,modes", [
    ("qwen2", {}, ["ulysses", "ring"]),
    ("qwen3", {}, ["allgather-lb"]),
    ("mistral", {"sliding_window": S}, ["ulysses", "allgather"]),
    ("gemma3", {"sliding_window": S}, ["ulysses", "allgather-lb"]),
    # windows shorter than the sequence (16) and than a rank's block (8) / a zigzag chunk (4)
    ("mistral", {"sliding_window": 6}, ["ulysses", "allgather", "allgather-lb", "ring", "zigzag"]),
    ("gemma3", {"sliding_window": 3}, ["ulysses", "allgather-lb", "ring", "zigzag"]),
    ("gemma2", dict(GEMMA2_CAPPED, sliding_window=5), ["allgather", "zigzag"]),
    ("gpt_oss", dict(GPT_OSS_SINKS, sliding_window=4), ["ulysses", "ring"]),
    ("gemma2", {"attn_logit_softcapping": None}, ["allgather"]),
    # weights large enough for a cap of 0.5 to change the scores (test_variants_change_the_model)
    ("gemma2", GEMMA2_CAPPED, ["ulysses", "allgather", "allgather-lb", "ring"]),
    ("gpt_oss", GPT_OSS_SINKS, ["ulysses", "allgather", "allgather-lb", "ring"]),
    ("phi3", {}, ["ulysses", "allgather"]),
    ("gpt_neox", {}, ["ulysses", "ring"]),
    ("gpt2", {}, ["allgather"]),
    ("deepseek_v3", {}, ["ulysses", "allgather-lb", "ring"]),
])
def test_family_trains_like_one_process(family, overrides, modes):
    assert run_dist(2, _exact, family, overrides, modes) == [True] * 2


def _exact_tp(rank, world_size, family):
    """TP 2 × CP 2 from the model's own plan (Phi-3's fused qkv_proj / gate_up_proj gather their
    output there: every rank keeps all heads), two AdamW steps vs one process."""
    import warnings

    import torch
    from hyper_parallel import DTensor, get_platform, init_device_mesh
    from hyper_parallel.integrations.transformers import parallelize_model
    from tests.hf_zoo import tiny

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp", "tp"))
    reference = tiny(family)
    ref_losses = _train(reference, _batches())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = parallelize_model(tiny(family), mesh)
    unmatched = [str(w.message) for w in caught if "matched no submodule" in str(w.message)]
    losses = _train(model, _batches(), mesh["cp"])
    for step, (loss, ref) in enumerate(zip(losses, ref_losses)):
        total = get_platform().all_reduce(loss, mesh["cp"].get_group())
        torch.testing.assert_close(total, ref, atol=1e-5, rtol=1e-5, msg=lambda m: f"{family} step {step}: {m}")
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        full = p.full_tensor() if isinstance(p, DTensor) else p
        torch.testing.assert_close(full.detach(), q.detach(), atol=1e-5, rtol=1e-5,
                                   msg=lambda m: f"{family} {name}: {m}")
    return unmatched


def test_phi3_fused_qkv_under_tp_trains_like_one_process():
    assert run_dist(4, _exact_tp, "phi3") == [[]] * 4


def _unmatched_entry(rank, world_size):
    import warnings

    from hyper_parallel import init_device_mesh
    from hyper_parallel.integrations.transformers import parallelize_model
    from tests.hf_zoo import tiny

    model = tiny("llama")
    model.tp_plan = dict(model.tp_plan, embed_out="colwise_gather_output")   # GPT-NeoX's old head name
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        parallelize_model(model, init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",)))
    return [str(w.message) for w in caught if "matched no submodule" in str(w.message)]


def test_tp_plan_entry_matching_nothing_warns():
    """A plan entry naming no module (GPT-NeoX's plan once named lm_head while its module was
    embed_out) leaves that module unsplit: a warning naming the entry, not silence."""
    assert all(any("'embed_out' matched no submodule" in m for m in r) for r in run_dist(2, _unmatched_entry))
