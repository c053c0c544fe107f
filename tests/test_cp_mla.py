"""MLA under all-gather KV (SPEC §12): DeepSeek-V3's compressed latent travels instead of per-head K/V
and is up-projected after the gather; DeepSeek-V3.2's sparse attention takes its top-k over the
global keys. Both train equal to one process (two AdamW steps: per-step loss, every weight, fp32
1e-5), the bytes on the wire equal the closed forms, and V3.2 in any other mode is refused."""
import pytest

from tests.harness import run_dist

pytest.importorskip("transformers")

B, S = 2, 16
# V3.2 with each query keeping 4 of up to 16 keys (the default 2048 would keep them all), and
# indexer / q-lora sizes small enough for a quick run
DSA = dict(index_topk=4, index_n_heads=4, index_head_dim=8, q_lora_rank=16)
LATENT = {"allgather": {"ulysses_degree": 1}, "allgather-lb": {"ulysses_degree": 1, "load_balance": True}}


def _trains(rank, world_size, family, overrides, modes):
    from tests.test_hf_model_zoo import trains_like_one_process
    return trains_like_one_process(family, overrides, [(m, LATENT[m]) for m in modes])


@pytest.mark.parametrize("family,overrides,world", [
    ("deepseek_v3", {}, 2),
    ("deepseek_v32", DSA, 2),
    ("deepseek_v32", DSA, 4),
])
def test_latent_path_trains_like_one_process(family, overrides, world):
    modes = ["allgather", "allgather-lb"]
    assert run_dist(world, _trains, family, overrides, modes, timeout=300) == [True] * world


def _sparsity_matters(rank, world_size):
    """The tiny V3.2's top-k changes its output (else exactness would not test the global top-k)."""
    import torch
    from tests.hf_zoo import tiny
    ids = torch.randint(0, 64, (B, S), generator=torch.Generator().manual_seed(1))
    sparse = tiny("deepseek_v32", **DSA)(input_ids=ids).logits
    dense = tiny("deepseek_v32", **dict(DSA, index_topk=S))(input_ids=ids).logits
    return float((sparse - dense).abs().max())


def test_dsa_top_k_changes_the_model():
    assert run_dist(1, _sparsity_matters)[0] > 1e-3


def _replaced(rank, world_size):
    """Which modes take the latent path: all-gather only (V3 keeps per-head K/V elsewhere)."""
    from hyper_parallel import init_device_mesh
    from hyper_parallel.integrations.hf_mla import make_mla_exact
    from tests.hf_zoo import tiny
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
    return {mode: len(make_mla_exact(tiny("deepseek_v3"), mesh, kwargs)) for mode, kwargs in [
        ("allgather", {"ulysses_degree": 1}), ("ulysses", {}),
        ("ring", {"ulysses_degree": 1, "kv_exchange": "ring"}), ("auto", {"mode": "auto"})]}


def test_only_allgather_takes_the_latent_path():
    assert run_dist(2, _replaced) == [{"allgather": 2, "ulysses": 0, "ring": 0, "auto": 0}] * 2


def _refused(rank, world_size):
    from hyper_parallel import init_device_mesh
    from hyper_parallel.integrations.transformers import parallelize_model
    from tests.hf_zoo import tiny
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
    for mode, kwargs in [("ulysses", {}), ("ring", {"ulysses_degree": 1, "kv_exchange": "ring"}),
                         ("auto", {"cp_mode": "auto"})]:
        match = rf"DeepSeek Sparse Attention.*the '{mode}' mode.*ulysses_degree=1"
        with pytest.raises(ValueError, match=match):
            parallelize_model(tiny("deepseek_v32", **DSA), mesh, **kwargs)
    return True


def test_dsa_refused_outside_allgather_on_every_rank():
    assert run_dist(2, _refused) == [True] * 2


def _attention_bytes(model, mesh):
    """Bytes this rank's all-gathers send in one forward of layer 0's attention, and the
    reduce-scatters of its backward."""
    import torch
    from hyper_parallel import get_platform, shard_sequence

    sent = {"all_gather": 0, "reduce_scatter": 0}

    def observe(op, nbytes, ranks):
        if op in sent:
            sent[op] += nbytes
    ids = shard_sequence([torch.randint(0, 64, (B, S), generator=torch.Generator().manual_seed(2))], mesh)[0]
    start = mesh.get_local_rank() * ids.shape[1]
    positions = torch.arange(start, start + ids.shape[1]).unsqueeze(0)
    hidden = model.model.embed_tokens(ids).detach().requires_grad_()
    rope = model.model.rotary_emb(hidden, positions)
    get_platform().add_comm_observer(observe)
    try:
        out = model.model.layers[0].self_attn(hidden_states=hidden, position_embeddings=rope,
                                              attention_mask=None, position_ids=positions)[0]
        out.square().sum().backward()
    finally:
        get_platform().remove_comm_observer(observe)
    return sent


def _bytes(rank, world_size, family, overrides):
    import hyper_parallel.integrations.transformers as hp_transformers
    from hyper_parallel import init_device_mesh
    from hyper_parallel.core.context_parallel.mla import latent_gather_bytes, per_head_gather_bytes
    from hyper_parallel.integrations.transformers import parallelize_model
    from tests.hf_zoo import tiny

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
    latent = _attention_bytes(parallelize_model(tiny(family, **overrides), mesh, ulysses_degree=1), mesh)
    c = tiny(family, **overrides).config
    index_dim = c.index_head_dim if family == "deepseek_v32" else 0
    want = latent_gather_bytes(B, S, world_size, c.kv_lora_rank, c.qk_rope_head_dim, 4, index_dim)
    no_grad = (world_size - 1) * B * (S // world_size) * index_dim * 4   # the indexer key: forward only
    assert latent == {"all_gather": want, "reduce_scatter": want - no_grad}
    if family == "deepseek_v32":
        return True
    # the per-head path, measured: the same model with the latent path switched off
    original = hp_transformers.make_mla_exact
    hp_transformers.make_mla_exact = lambda *args, **kwargs: []
    try:
        model = parallelize_model(tiny(family, **overrides), mesh, ulysses_degree=1)
        per_head = _attention_bytes(model, mesh)
    finally:
        hp_transformers.make_mla_exact = original
    heads, qk = c.num_attention_heads, c.qk_nope_head_dim + c.qk_rope_head_dim
    assert per_head["all_gather"] == per_head_gather_bytes(B, S, world_size, heads, qk, c.v_head_dim, 4)
    return True


@pytest.mark.parametrize("family,overrides", [("deepseek_v3", {}), ("deepseek_v32", DSA)])
def test_bytes_equal_the_closed_form(family, overrides):
    assert run_dist(2, _bytes, family, overrides) == [True] * 2


def test_deepseek_v3_ratio():
    """DeepSeek-V3's real shapes: H=128, d_qk = 128 + 64, d_v = 128, kv_lora_rank = 512, rope 64."""
    from hyper_parallel.core.context_parallel.mla import (latent_gather_bytes, latent_ratio,
                                                          per_head_gather_bytes)
    ratio = latent_ratio(128, 192, 128, 512, 64)
    assert ratio == pytest.approx(40960 / 576) and 71 < ratio < 71.2
    per_head = per_head_gather_bytes(1, 131072, 8, 128, 192, 128, 2)
    assert per_head == ratio * latent_gather_bytes(1, 131072, 8, 512, 64, 2)


def _padded(rank, world_size, family, overrides, kwargs, packed=False):
    """A right-padded batch (or two packed documents per row): logits of the kept tokens and every
    gradient equal one process."""
    import torch
    from hyper_parallel import get_platform, init_device_mesh, shard_sequence
    from hyper_parallel.integrations.transformers import parallelize_model
    from tests.hf_zoo import VOCAB, tiny

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
    ids = torch.randint(0, VOCAB, (B, S), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(B, S, dtype=torch.long)
    mask[1, 11:] = 0
    positions = torch.cat([torch.arange(7), torch.arange(S - 7)]).expand(B, S)
    inputs = {"position_ids": positions} if packed else {"attention_mask": mask}
    reference = tiny(family, **overrides)
    # use_cache=False: transformers separates packed documents only without a cache, and so does CP
    (reference(input_ids=ids, use_cache=False, **inputs).logits * mask[..., None]).square().sum().backward()
    model = parallelize_model(tiny(family, **overrides), mesh, **kwargs)
    local_ids, local_mask, local = shard_sequence([ids, mask] + list(inputs.values()), mesh)
    local_inputs = {next(iter(inputs)): local}
    out = model(input_ids=local_ids, use_cache=False, **local_inputs).logits
    (out * local_mask[..., None]).square().sum().backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        # no gradient: the indexer (no_grad in transformers), an expert no token of a rank chose
        mine = torch.zeros_like(p) if p.grad is None else p.grad
        want = torch.zeros_like(q) if q.grad is None else q.grad
        grad = get_platform().all_reduce(mine, mesh.get_group())
        torch.testing.assert_close(grad, want, atol=1e-5, rtol=1e-5, msg=lambda m: f"{family} {name}: {m}")
    return True


@pytest.mark.parametrize("family,overrides,kwargs,packed", [
    # d_v != d_qk through the masked tile kernel (it once built dV's empty tiles like k: a crash)
    ("deepseek_v3", {}, {"ulysses_degree": 1, "load_balance": True}, False),
    ("deepseek_v3", {}, {"ulysses_degree": None}, False),     # the per-head path (Ulysses)
    ("deepseek_v32", DSA, {"ulysses_degree": 1}, False),
    ("deepseek_v32", DSA, {"ulysses_degree": 1, "load_balance": True}, False),
    ("deepseek_v32", DSA, {"ulysses_degree": 1}, True),
])
def test_masks_on_the_latent_path(family, overrides, kwargs, packed):
    assert run_dist(2, _padded, family, overrides, kwargs, packed, timeout=300) == [True] * 2
