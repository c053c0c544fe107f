"""parallelize_model on a tiny Hugging Face Llama: TP from its own plan × CP through the
AttentionInterface (Ulysses, all-gather KV, load balance), with padding masks and packed
position_ids, plus data_parallel — loss and every parameter gradient against the unparallelized
model on one process."""
import pytest

from tests.harness import run_dist

pytest.importorskip("transformers")

B, S, VOCAB = 2, 16, 64


def _config(**overrides):
    from transformers import LlamaConfig
    kwargs = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64)
    kwargs.update(overrides)
    return LlamaConfig(**kwargs)


def _model(config):
    import torch
    from transformers import LlamaForCausalLM
    torch.manual_seed(0)
    return LlamaForCausalLM(config).float()


def _batch(variant, seed=3):
    """input_ids, globally shifted labels, padding mask or None, position_ids or None."""
    import torch
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (B, S), generator=g)
    labels = torch.cat([ids[:, 1:], torch.full((B, 1), -100)], 1)
    mask = positions = None
    if variant == "padding":
        mask = torch.ones(B, S, dtype=torch.long)
        mask[0, :3] = 0   # left padding
        mask[1, -5:] = 0  # right padding
        labels = labels.masked_fill((mask == 0) | (torch.cat([mask[:, 1:], mask[:, :1] * 0], 1) == 0), -100)
    elif variant == "packed":
        positions = torch.stack([torch.cat([torch.arange(5), torch.arange(7), torch.arange(4)]),
                                 torch.cat([torch.arange(9), torch.arange(7)])])
    return ids, labels, mask, positions


def _loss(logits, labels, count):
    import torch.nn.functional as F
    flat = logits.flatten(0, 1).float()
    return F.cross_entropy(flat, labels.flatten(), ignore_index=-100, reduction="sum") / count


def _reference(config, batch):
    model = _model(config)
    ids, labels, mask, positions = batch
    # use_cache=False: transformers separates packed documents only without a cache, and so does CP
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False).logits
    loss = _loss(logits, labels, (labels != -100).sum())
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def _compare(torch, model, loss, ref, what, cp_group):
    from hyper_parallel import DTensor, get_platform
    total = get_platform().all_reduce(loss.detach(), cp_group)
    torch.testing.assert_close(total, ref[0], atol=1e-5, rtol=1e-5, msg=lambda m: f"{what} loss: {m}")
    for name, p in model.named_parameters():
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        torch.testing.assert_close(grad, ref[1][name], atol=1e-5, rtol=1e-5,
                                   msg=lambda m: f"{what} {name}: {m}")


def _step(model, batch, cp_mesh):
    from hyper_parallel import shard_sequence
    ids, labels, mask, positions = batch
    count = (labels != -100).sum()          # the global token count
    ids, labels, mask, positions = shard_sequence([ids, labels, mask, positions], cp_mesh)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False).logits
    return _loss(logits, labels, count)


def _tp_cp(rank, world_size):
    import torch
    from hyper_parallel import data_parallel, init_device_mesh
    from hyper_parallel.integrations.transformers import parallelize_model

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp", "tp"))
    config = _config()
    refs = {v: _reference(config, _batch(v)) for v in ("plain", "padding", "packed")}
    for mode, kwargs in {"ulysses": {}, "allgather": {"ulysses_degree": 1},
                         "allgather-lb": {"ulysses_degree": 1, "load_balance": True}}.items():
        model = parallelize_model(_model(config), mesh, **kwargs)
        data_parallel(model, mesh["cp"], average=False)
        for variant, ref in refs.items():
            model.zero_grad(set_to_none=True)
            loss = _step(model, _batch(variant), mesh["cp"])
            loss.backward()
            _compare(torch, model, loss, ref, f"{mode}/{variant}", mesh["cp"].get_group())
    return True


def test_hf_llama_tp2_cp2_every_mode_padding_and_packing():
    assert run_dist(4, _tp_cp) == [True] * 4


def _dp_cp(rank, world_size):
    """No "tp" dim: CP on "cp", data_parallel over the flattened dp×cp mesh, different batches per dp."""
    import torch
    from hyper_parallel import data_parallel, get_platform, init_device_mesh
    from hyper_parallel.integrations.transformers import parallelize_model

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    config = _config(tie_word_embeddings=True)
    model = parallelize_model(_model(config), mesh, ulysses_degree=1)
    assert config._attn_implementation != model.config._attn_implementation  # a shared config is left alone
    data_parallel(model, mesh["dp", "cp"].flatten(), average=False)
    batches = [_batch("padding", seed=10 + d) for d in range(2)]
    # global count over every dp×cp rank: the per-rank losses add up to the global mean
    count = sum((b[1] != -100).sum() for b in batches)
    ref_model = _model(config)
    ref_loss = sum(_loss(ref_model(input_ids=b[0], attention_mask=b[2]).logits, b[1], count) for b in batches)
    ref_loss.backward()
    ids, labels, mask, _ = batches[mesh["dp"].get_local_rank()]
    from hyper_parallel import shard_sequence
    ids, labels, mask = shard_sequence([ids, labels, mask], mesh["cp"])
    loss = _loss(model(input_ids=ids, attention_mask=mask).logits, labels, count)
    loss.backward()
    total = get_platform().all_reduce(loss.detach(), mesh["dp", "cp"].flatten().get_group())
    torch.testing.assert_close(total, ref_loss.detach(), atol=1e-5, rtol=1e-5)
    for (name, p), (_, q) in zip(model.named_parameters(), ref_model.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-5, msg=lambda m: f"{name}: {m}")
    return True


def test_hf_llama_cp_with_dp_no_tp():
    assert run_dist(4, _dp_cp) == [True] * 4


def _errors(rank, world_size):
    import torch
    from hyper_parallel import init_device_mesh, shard_sequence
    from hyper_parallel.integrations.transformers import parallelize_model, translate_plan

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp", "tp"))
    ids, labels, mask, positions = shard_sequence(list(_batch("padding")), mesh["cp"])
    ring = parallelize_model(_model(_config()), mesh, ulysses_degree=1, kv_exchange="ring")
    ring(input_ids=ids)
    ring(input_ids=ids, attention_mask=mask)  # masks in the ring: tests/test_hf_masks.py checks the values
    model = parallelize_model(_model(_config()), mesh)
    with pytest.raises(ValueError, match="attention_mask of shape"):
        model(input_ids=ids, attention_mask=torch.ones(B, 1, S // 2, S, dtype=torch.bool))
    with pytest.raises(ValueError, match="position_ids of shape"):
        model(input_ids=ids, position_ids=torch.arange(S)[None])
    with pytest.raises(ValueError, match="position_ids of shape"):
        model(input_ids=ids, position_ids=torch.arange(S // 2).repeat(3, 1))
    with pytest.raises(ValueError, match="already applied"):
        parallelize_model(model, mesh)
    with pytest.raises(ValueError, match="does not translate"):
        translate_plan({"experts": "grouped_gemm"})
    with pytest.raises(ValueError, match="not divisible by the TP size"):
        parallelize_model(_model(_config(num_key_value_heads=1)), mesh)
    with pytest.raises(ValueError, match="neither"):
        parallelize_model(_model(_config()), init_device_mesh("cpu", (4,), mesh_dim_names=("dp",)))
    return True


def test_hf_errors():
    assert run_dist(4, _errors) == [True] * 4


def test_example_train_llama_hf_check():
    """examples/train_llama_hf.py --check at a tiny size: spawns its own ranks, trains, and exits 0
    only if every step's loss equals the single-process run to 1e-5."""
    import os
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parents[1]
    launcher = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in launcher}
    env["HP_STRICT_DISPATCH"] = "1"  # no op of the step may take the replicated fallback (issue 15)
    cmd = [sys.executable, str(root / "examples" / "train_llama_hf.py"), "--cp", "2", "--mode",
           "allgather-lb", "--steps", "2", "--seq", "16", "--hidden", "32", "--vocab", "64", "--check"]
    done = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "[2/2] loss" in done.stdout and "max |loss - single-process loss|" in done.stdout, done.stdout


def test_example_hybrid_needs_four_cp_ranks():
    """--mode hybrid at --cp 2 would be plain Ulysses under the hybrid's name: refused before any
    process starts (both torch examples share the check)."""
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parents[1]
    for example in ("train_llama_hf.py", "train_llama_titan.py"):
        done = subprocess.run([sys.executable, str(root / "examples" / example), "--cp", "2", "--mode", "hybrid"],
                              cwd=root, capture_output=True, text=True, timeout=120)
        assert done.returncode != 0 and "needs an even --cp of at least 4" in done.stderr, done.stderr


def _hf_loss_keywords(rank, world_size):
    """transformers hands the loss's keywords (labels, shift_labels, num_items_in_batch) to every
    layer and so to the attention function: they pass through, and HF's own loss with globally
    shifted labels and the global count sums over the CP ranks to the single-process loss."""
    import torch
    from hyper_parallel import get_platform, init_device_mesh, shard_sequence
    from hyper_parallel.integrations.transformers import parallelize_model

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
    ids, labels, _, _ = _batch("plain")
    count = (labels != -100).sum()
    ref = _model(_config())(input_ids=ids, labels=ids).loss   # HF shifts within the whole sequence
    model = parallelize_model(_model(_config()), mesh)
    local_ids, local_labels = shard_sequence([ids, labels], mesh)
    loss = model(input_ids=local_ids, labels=local_labels, shift_labels=local_labels, num_items_in_batch=count).loss
    torch.testing.assert_close(get_platform().all_reduce(loss.detach(), mesh.get_group()), ref.detach())
    return True


def test_hf_loss_keywords_pass_through_context_parallel_attention():
    assert run_dist(2, _hf_loss_keywords) == [True, True]


def _seq_as_long_as_head_dim(rank, world_size):
    """S == head_dim: the CP output has two dims of the sequence's length; each mode stays exact
    (the core attention returns q's layout, so the output's sequence dim is never guessed)."""
    import torch
    from hyper_parallel import data_parallel, init_device_mesh
    from hyper_parallel.integrations.transformers import parallelize_model

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
    config = _config(hidden_size=4 * S)          # 4 heads of head_dim S
    batch = _batch("plain")
    ref = _reference(config, batch)
    for mode, kwargs in {"ulysses": {}, "allgather": {"ulysses_degree": 1},
                         "ring": {"ulysses_degree": 1, "kv_exchange": "ring"}}.items():
        model = parallelize_model(_model(config), mesh, **kwargs)
        data_parallel(model, mesh, average=False)
        loss = _step(model, batch, mesh["cp"])
        loss.backward()
        _compare(torch, model, loss, ref, mode, mesh.get_group())
    return True


def test_hf_sequence_as_long_as_head_dim():
    assert run_dist(2, _seq_as_long_as_head_dim) == [True] * 2
