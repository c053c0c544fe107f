"""Hugging Face RoPE under context parallelism (SPEC §19, round-4 attack): parallelize_model's setup
probes ran the model on a 26-token sequence and left a dynamic rotary embedding grown to it
(``max_seq_len_cached`` 26, ``inv_freq`` of length 26), so a model trained on 16 tokens computed
with another frequency table than one process: gradients off by 7e-3, silently. The probes now leave
every module's buffers and plain attributes as they found them."""
from tests.harness import run_dist


def _dynamic_rope(rank, world_size):
    import copy
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from hyper_parallel import init_device_mesh, shard_sequence
    from hyper_parallel.integrations.transformers import parallelize_model

    config = LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=8, intermediate_size=48, max_position_embeddings=8,
                         rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    torch.manual_seed(0)
    ref = LlamaForCausalLM(config).float()
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",), timeout=30)
    model = parallelize_model(copy.deepcopy(ref), mesh)
    rotary = model.model.rotary_emb
    assert rotary.max_seq_len_cached == ref.model.rotary_emb.max_seq_len_cached == 8
    torch.testing.assert_close(rotary.inv_freq, ref.model.rotary_emb.inv_freq, rtol=0, atol=0)
    ids = torch.randint(0, 64, (1, 16), generator=torch.Generator().manual_seed(3))
    out = model(input_ids=shard_sequence(ids, mesh, seq_dim=1), use_cache=False).logits
    expected = ref(input_ids=ids, use_cache=False).logits
    torch.testing.assert_close(out, shard_sequence(expected, mesh, seq_dim=1), rtol=0, atol=1e-5)
    return True


def test_dynamic_rope_state_survives_the_setup_probes():
    assert run_dist(2, _dynamic_rope, timeout=120) == [True, True]
