"""ExpertParallel (SPEC §17): MoE experts split over the ep ranks, against one process on the global
batch — per-step loss (the global load-balancing loss included), router and expert gradients and the
weights after AdamW (fp32, 1e-5) — for the Hugging Face MoE families, expert bytes per rank, bytes
sent against the closed form from the routing counts, collective counts, bad input, gradcheck."""
import pytest

from tests.harness import run_dist

pytest.importorskip("transformers")

VOCAB, SEQ = 64, 12
_BASE = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=VOCAB, max_position_embeddings=64)
_AUX = dict(output_router_logits=True, router_aux_loss_coef=0.1)
# family -> (config class, model class, config keywords); 8 experts, top-2
FAMILIES = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        _BASE, **_AUX, head_dim=8, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
        intermediate_size=48, norm_topk_prob=True)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(
        _BASE, **_AUX, num_local_experts=8, num_experts_per_tok=2, intermediate_size=16)),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        _BASE, num_key_value_heads=4, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=8,
        v_head_dim=6, head_dim=4, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
        first_k_dense_replace=1, n_group=2, topk_group=1, intermediate_size=48, n_shared_experts=1)),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(
        _BASE, **_AUX, intermediate_size=16, head_dim=8, num_local_experts=8, num_experts_per_tok=2,
        sliding_window=64)),
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(
        _BASE, **_AUX, head_dim=8, linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8,
        linear_value_head_dim=8, layer_types=["linear_attention", "full_attention"], num_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16)),
    "kimi_linear": ("KimiLinearConfig", "KimiLinearForCausalLM", dict(
        _BASE, num_key_value_heads=4, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=8,
        v_head_dim=6, head_dim=4, pad_token_id=0, bos_token_id=1, eos_token_id=2, linear_head_dim=8,
        linear_num_heads=4, num_experts=8, num_experts_per_token=2, moe_intermediate_size=16,
        layer_types=["linear_attention", "full_attention"])),
}


def make(family, **overrides):
    """A fresh fp32 tiny model of ``family`` (the same weights on every call); the router weights
    are random (Hugging Face initialises some to zero, which would route every token alike)."""
    import torch
    import transformers
    config_class, model_class, kwargs = FAMILIES[family]
    config = getattr(transformers, config_class)(**dict(kwargs, **overrides))
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(config).float()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("gate.weight", "router.weight")) or "experts." in name:
                param.normal_(0.0, 0.3)
    return model


def ids(index, step):
    import torch
    return torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(100 * step + index))


def _mean_over_ranks(value, group):
    from hyper_parallel import get_platform
    platform = get_platform()
    return platform.all_reduce(value.detach().clone(), group, "sum") / platform.get_world_size(group)


def _full(tensor):
    from hyper_parallel import DTensor
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _check_step(model, ref, opt, ref_opt, what, out, ref_out):
    """Aux loss, every gradient, then one AdamW step: the weights."""
    import torch
    if ref_out.aux_loss is not None:
        torch.testing.assert_close(out.aux_loss.detach(), ref_out.aux_loss.detach(), atol=1e-6, rtol=1e-5)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(_full(p.grad), q.grad, atol=1e-5, rtol=1e-5,
                                   msg=lambda m, n=name: f"{what} grad {n}: {m}")
    opt.step()
    ref_opt.step()
    opt.zero_grad()
    ref_opt.zero_grad()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(_full(p.detach()), q.detach(), atol=1e-5, rtol=1e-5,
                                   msg=lambda m, n=name: f"{what} weight {n}: {m}")


def _optimizers(model, ref):
    import torch
    # eps 1e-6, lr 1e-3: Adam turns a gradient of ~1e-9 into a full step whatever its rounding;
    # gradients are compared exactly before the step
    return (torch.optim.AdamW(m.parameters(), lr=1e-3, eps=1e-6) for m in (model, ref))


def train_case(rank, world_size, family, steps=2, tp=1):
    """ep over every data rank (mesh ('dp_shard',), or ('dp_shard', 'tp') with attention under TP),
    losses averaged: ``steps`` AdamW steps against one process on the global batch."""
    import torch
    from hyper_parallel import DTensor, init_device_mesh
    from hyper_parallel.integrations.transformers import parallelize_model
    data = world_size // tp
    shape, names = ((data,), ("dp_shard",)) if tp == 1 else ((data, tp), ("dp_shard", "tp"))
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    model, ref = parallelize_model(make(family), mesh, ep="dp_shard"), make(family)
    experts = [p for n, p in model.named_parameters() if ".experts." in n]
    assert experts and all(isinstance(p, DTensor) and p.to_local().shape[0] == 8 // data for p in experts)
    opt, ref_opt = _optimizers(model, ref)
    index, group = mesh.get_local_rank(0), mesh["dp_shard"].get_group(0) if tp > 1 else mesh.get_group(0)
    for step in range(steps):
        out = model(input_ids=ids(index, step), labels=ids(index, step))
        out.loss.backward()
        batch = torch.cat([ids(i, step) for i in range(data)])
        ref_out = ref(input_ids=batch, labels=batch)
        ref_out.loss.backward()
        torch.testing.assert_close(_mean_over_ranks(out.loss, group), ref_out.loss.detach(),
                                   atol=1e-5, rtol=1e-5)
        _check_step(model, ref, opt, ref_opt, f"{family} ep={data} tp={tp}", out, ref_out)
    return True


def tp_one_step(rank, world_size, family):
    return train_case(rank, world_size, family, steps=1, tp=2)


def tp_families_case(rank, world_size, families):
    return [train_case(rank, world_size, family, tp=2) for family in families]


def _shifted(tokens):
    import torch
    return torch.cat([tokens[:, 1:], torch.full_like(tokens[:, :1], -100)], 1)


def cp_case(rank, world_size, family, ep, steps=2):
    """Mesh (dp_shard 2, cp 2): experts over ``ep`` ('dp_shard': then fully_shard-ed over cp; or
    ('dp_shard', 'cp')), each rank its sequence block; the ranks' losses sum to the global loss
    (``average=False``, the global token count)."""
    import torch
    from hyper_parallel import get_platform, init_device_mesh, shard_sequence
    from hyper_parallel.integrations.transformers import parallelize_model
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "cp"))
    model, ref = parallelize_model(make(family), mesh, ep=ep, average=False), make(family)
    opt, ref_opt = _optimizers(model, ref)
    for step in range(steps):
        tokens = ids(mesh.get_local_rank(0), step)
        count = torch.tensor(2 * (SEQ - 1))
        local_ids, local_labels = shard_sequence([tokens, _shifted(tokens)], mesh["cp"])
        out = model(input_ids=local_ids, labels=local_labels, shift_labels=local_labels,
                    num_items_in_batch=count, use_cache=False)   # CP refuses a linear-attention cache
        out.loss.backward()
        batch = torch.cat([ids(i, step) for i in range(2)])
        ref_out = ref(input_ids=batch, labels=batch)
        ref_out.loss.backward()
        total = out.loss.detach().clone()
        for d in range(2):
            total = get_platform().all_reduce(total, mesh.get_group(d), "sum")
        torch.testing.assert_close(total, ref_out.loss.detach(), atol=1e-5, rtol=1e-5)
        _check_step(model, ref, opt, ref_opt, f"{family} ep={ep}", out, ref_out)
    return True


def families_case(rank, world_size, families):
    return [train_case(rank, world_size, family) for family in families]


def cp_families_case(rank, world_size, cases):
    return [cp_case(rank, world_size, family, ep) for family, ep in cases]


def test_families_sample():
    """The default run: two families at ep 2 (Qwen3-MoE with its global aux loss; DeepSeek-V3: shared
    experts, a dense first layer, grouped routing), ep 4 over (dp_shard, cp) under context parallelism."""
    assert run_dist(2, families_case, ["qwen3_moe", "deepseek_v3"], timeout=600) == [[True] * 2] * 2
    assert run_dist(4, cp_families_case, [("qwen3_moe", ("dp_shard", "cp"))], timeout=600) == [[True]] * 4


ALL = sorted(FAMILIES)


@pytest.mark.ep_full
@pytest.mark.parametrize("world_size", [2, 4])
def test_every_family(world_size):
    assert run_dist(world_size, families_case, ALL, timeout=600) == [[True] * len(ALL)] * world_size


@pytest.mark.ep_full
def test_every_family_under_tp():
    """Mesh (dp_shard 2, tp 2): attention (and shared experts) under the model's TP plan, experts
    over dp_shard; every tp rank routes the same tokens within its own ep group. DeepSeek-V3's MLA
    ``kv_a_proj_with_mqa`` runs under the 'mla_kv_a_proj' style (hf_mla_tensor_parallel.py);
    Kimi-Linear's plan splits its MLPs and shared experts only."""
    assert run_dist(4, tp_families_case, ALL, timeout=900) == [[True] * len(ALL)] * 4


def test_mla_under_tp():
    """The default run's ep x tp sample: DeepSeek-V3 (MLA's kv_a_proj_with_mqa under TP, one step)."""
    assert run_dist(4, tp_one_step, "deepseek_v3", timeout=600) == [True] * 4


@pytest.mark.ep_full
@pytest.mark.parametrize("ep", ["dp_shard", ("dp_shard", "cp")])
def test_every_family_under_cp(ep):
    cases = [(family, ep) for family in ALL]
    assert run_dist(4, cp_families_case, cases, timeout=900) == [[True] * len(cases)] * 4


def _step_and_save(rank, world_size, path):
    """ep = 4: one AdamW step, then a DCP checkpoint of the model (experts as Shard(0) DTensors)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from hyper_parallel import init_device_mesh
    from hyper_parallel.integrations.transformers import parallelize_model
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp_shard",))
    model = parallelize_model(make("qwen3_moe"), mesh, ep="dp_shard")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6)
    model(input_ids=ids(rank, 0), labels=ids(rank, 0)).loss.backward()
    opt.step()
    dcp.save({"model": model.state_dict()}, checkpoint_id=path)
    return True


def reference_after_step(world_size):
    import torch
    ref = make("qwen3_moe")
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, eps=1e-6)
    batch = torch.cat([ids(i, 0) for i in range(world_size)])
    ref(input_ids=batch, labels=batch).loss.backward()
    opt.step()
    return ref


def _load(rank, world_size, path):
    """The ep-4 checkpoint into ep 2: the weights of one process after the step, and the next step's
    loss equal too."""
    import torch
    import torch.distributed.checkpoint as dcp
    from hyper_parallel import init_device_mesh
    from hyper_parallel.integrations.transformers import parallelize_model
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp_shard",))
    model = parallelize_model(make("qwen3_moe", num_hidden_layers=2), mesh, ep="dp_shard")
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().zero_()
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=path)
    ref = reference_after_step(4)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(_full(p.detach()), q.detach(), atol=1e-6, rtol=1e-6, msg=name)
    loss = model(input_ids=ids(rank, 1), labels=ids(rank, 1)).loss
    batch = torch.cat([ids(i, 1) for i in range(world_size)])
    torch.testing.assert_close(_mean_over_ranks(loss, mesh.get_group(0)),
                               ref(input_ids=batch, labels=batch).loss.detach(), atol=1e-5, rtol=1e-5)
    return True


def test_checkpoint_ep4_to_ep2_to_one_process(tmp_path):
    import torch
    import torch.distributed.checkpoint as dcp
    path = str(tmp_path / "ep4")
    assert run_dist(4, _step_and_save, path, timeout=600) == [True] * 4
    assert run_dist(2, _load, path, timeout=600) == [True] * 2
    model = make("qwen3_moe")
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=path, no_dist=True)
    model.load_state_dict(state["model"])
    for (name, p), q in zip(model.named_parameters(), reference_after_step(4).parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), atol=1e-6, rtol=1e-6, msg=name)


def _hf_errors(rank, world_size):
    """parallelize_model(ep=...) bad input: the same ValueError on every rank, before any collective."""
    from hyper_parallel import CommDebugMode, init_device_mesh
    from hyper_parallel.integrations.transformers import parallelize_model
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp_shard",))
    cases = [({"ep": "ep"}, "qwen3_moe", {}, "has no 'ep' dim"),
             ({"ep": "dp_shard"}, "qwen3_moe", {"num_experts": 3},
              "3 experts are not divisible by the ep size 2"),
             ({"ep": "dp_shard"}, "mixtral", {"num_experts_per_tok": 9}, "top-k 9 exceeds the 8 experts"),
             ({"ep": 3}, "qwen3_moe", {}, "pass a mesh dim name")]
    with CommDebugMode() as comm:
        for kwargs, family, overrides, text in cases:
            with pytest.raises(ValueError, match=text):
                parallelize_model(make(family, **overrides), mesh, **kwargs)
    assert comm.get_total_counts() == 0
    square = init_device_mesh("cpu", (1, world_size), mesh_dim_names=("ep", "dp_shard"))
    with pytest.raises(ValueError, match="'ep' is not a data dim"):
        parallelize_model(make("qwen3_moe"), square, ep="ep")
    return True


def _hf_disagree(rank, world_size):
    """Ranks whose routing settings differ (top-k, experts, normalisation, scaling, aux-loss
    coefficient): every rank raises naming the setting, before any parameter moves."""
    from hyper_parallel import init_device_mesh
    from hyper_parallel.integrations.transformers import parallelize_model
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp_shard",))
    cases = [("qwen3_moe", {"num_experts_per_tok": 2 + rank}, "config.num_experts_per_tok"),
             ("qwen3_moe", {"num_experts": 8 if rank else 4}, "config.num_experts"),
             ("qwen3_moe", {"norm_topk_prob": rank == 0}, "config.norm_topk_prob"),
             ("mixtral", {"router_aux_loss_coef": 0.1 * (rank + 1)}, "router_aux_loss_coef"),
             ("deepseek_v3", {"routed_scaling_factor": 1.0 + rank}, "config.routed_scaling_factor")]
    for family, overrides, name in cases:
        model = make(family, **overrides)
        with pytest.raises(ValueError, match=f"disagree on .*{name} \\(rank {rank} has"):
            parallelize_model(model, mesh, ep="dp_shard")
        assert not any(hasattr(p, "placements") for p in model.parameters())   # nothing moved
    return True


def test_parallelize_model_bad_input():
    assert run_dist(2, _hf_errors) == [True, True]
    assert run_dist(2, _hf_disagree) == [True, True]
