"""Hugging Face families under context parallelism (SPEC §19): global positions wherever the model's
forward enters, restrictions that live only in the model's masks, the chunked loss's logit scalings,
``verify=True``. A fast sample of tests/hf_sweep.py runs by default (one forward + backward on CP 2
against one process: logits and every parameter gradient to fp32 1e-5, or a refusal naming the reason
at ``parallelize_model``); the whole sweep is ``-m hf_sweep_full``."""
import pytest

from tests.harness import run_dist

pytest.importorskip("transformers")

# (model type, rope type, CP mode) -> expected verdict, and a part of the refusal's text
SAMPLE = {
    ("opt", "default", "ulysses"): ("exact", ""),              # its *ForCausalLM calls the decoder directly
    ("bart", "default", "allgather"): ("exact", ""),           # a BART decoder: positions from cache_length
    ("roberta", "default", "ulysses"): ("exact", ""),          # positions from padding_idx + 1
    ("qwen2_moe", "default", "allgather-lb"): ("exact", ""),   # a sliding window only in the mask
    ("bigbird_pegasus", "default", "zigzag"): ("exact", ""),   # a decoder called directly, eager masks
    ("llama", "dynamic", "ulysses"): ("exact", ""),            # scaling chosen from the global length
    ("phi3", "longrope", "allgather"): ("exact", ""),          # long factors past the original length
    ("afmoe", "default", "ring"): ("exact", ""),               # .view()s the attention output
    ("llama4_text", "default", "ulysses"): ("exact", ""),      # temperature from the cache's past length
}


def _sample(rank, world_size, cases):
    from tests.hf_sweep import sweep_worker
    return sweep_worker(rank, world_size, cases)


def test_hf_sweep_sample():
    cases = list(SAMPLE)
    verdicts = run_dist(2, _sample, cases, timeout=600)
    assert verdicts[0] == verdicts[1]
    for case, (verdict, detail) in zip(cases, verdicts[0]):
        expected, text = SAMPLE[case]
        assert (verdict, text in detail) == (expected, True), f"{case}: {verdict} {detail}"


@pytest.mark.hf_sweep_full
def test_hf_sweep_full():
    """Every causal-LM type: no silent and no obscure verdict."""
    from tests.hf_sweep import MODES, causal_lm_types, run_cases
    types = causal_lm_types()
    results = run_cases([(t, "default", m) for t in types for m in MODES])
    bad = {case: v for case, v in results.items() if v[0] in ("silent", "obscure")}
    assert not bad, bad


def test_mask_classification():
    """The model's own mask functions, read on rows of a long grid: causal, window, chunks, bidirectional;
    a bidirectional window and a prefix are refused."""
    import torch
    from transformers import masking_utils as mu

    from hyper_parallel.integrations.hf_mask_probe import MaskSpec, Restriction, classify
    no_pad = torch.zeros(1, dtype=torch.long)
    prefix = mu.or_masks(mu.causal_mask_function, lambda b, h, q, k: k < 4)
    cases = [(mu.causal_mask_function, Restriction()),
             (mu.sliding_window_causal_mask_function(3), Restriction(window=3)),
             (mu.sliding_window_causal_mask_function(700), Restriction(window=700)),
             (mu.chunked_causal_mask_function(6, no_pad), Restriction(chunk=6)),
             (mu.bidirectional_mask_function, Restriction(causal=False)),
             (mu.sliding_window_bidirectional_mask_function(3), None),
             (prefix, None)]
    for function, expected in cases:
        assert classify(MaskSpec(function, 1, 1), 2 ** 11)[0] == expected


def test_chunked_loss_probe_refuses_logit_scalings():
    """loss='chunked' measures logits against hidden @ lm_head.weight.T: Falcon-H1's lm_head multiplier,
    Gemma 2's final soft-capping and Cohere's logit_scale are refused, a plain Llama is not."""
    import torch
    import transformers

    from hyper_parallel.integrations.hf_chunked_loss import probe_logits
    base = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=64, max_position_embeddings=64)
    torch.manual_seed(0)
    probe_logits(transformers.LlamaForCausalLM(transformers.LlamaConfig(**base)))
    scaled = [("Gemma2ForCausalLM", "Gemma2Config", {"head_dim": 8, "final_logit_softcapping": 0.5}),
              ("CohereForCausalLM", "CohereConfig", {"logit_scale": 0.3}),
              ("FalconH1ForCausalLM", "FalconH1Config", {"lm_head_multiplier": 0.5, "head_dim": 8,
                                                         "mamba_d_ssm": 16, "mamba_n_heads": 4,
                                                         "mamba_d_head": 4, "mamba_d_state": 8})]
    for model_name, config_name, extra in scaled:
        model = getattr(transformers, model_name)(getattr(transformers, config_name)(**dict(base, **extra)))
        with pytest.raises(ValueError, match=f"{model_name}('s logits are not its last hidden state| transforms)"):
            probe_logits(model)


def _verify(rank, world_size):
    import torch
    from hyper_parallel import init_device_mesh
    from hyper_parallel.integrations.hf_mask_probe import Restriction
    from hyper_parallel.integrations.hf_verify import verify_context_parallel
    from hyper_parallel.integrations.transformers import parallelize_model
    from tests.hf_sweep import tiny

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
    config, model_class = tiny("qwen2_moe")
    torch.manual_seed(0)
    model = parallelize_model(model_class(config).float(), mesh, verify=True)   # passes: CP is exact
    state = model._hp_cp_attention
    for module in list(state.restrictions):   # break it: drop the window the model's mask asks for
        state.restrictions[module] = Restriction()
    with pytest.raises(ValueError, match=r"layer model\.layers\.0 computes a different output"):
        verify_context_parallel(model, state)
    return True


def test_verify_names_the_first_layer_that_differs():
    assert run_dist(2, _verify) == [True, True]


def _block_cache(rank, world_size, mode, floor_scale=4):
    """Llama 4's NoPE layers scale queries by a temperature of positions counted from the KV cache's past
    length: each rank is handed its block's start (hf_block_cache.py), also when activation checkpointing
    recomputes the layer in backward, outside the forward."""
    import copy

    import torch
    from hyper_parallel import init_device_mesh
    from hyper_parallel.integrations.transformers import parallelize_model
    from tests.hf_sweep import MODES, _batch, _difference, _reference, _under_cp, tiny

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",), timeout=60)
    config, model_class = tiny("llama4_text")
    assert config.attn_temperature_tuning and config.no_rope_layers.count(0) >= 1
    # 32: the temperature steps first at position 31, past the setup probe's 26 tokens, so the probe
    # sees no difference; it finds the module by its reading the cache's length (64 tokens here)
    config.floor_scale = floor_scale
    torch.manual_seed(0)
    reference = model_class(config).float()
    model = copy.deepcopy(reference)
    for m in (reference, model):
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        m.train()
    ids, labels = _batch(int(config.vocab_size))
    if floor_scale > 4:
        ids = ids.repeat(1, 4)
        labels = torch.cat([ids[:, 1:], torch.full((ids.shape[0], 1), -100)], 1)
    ref_logits, ref_grads = _reference(reference, ids, labels)
    parallelize_model(model, mesh, **MODES[mode])
    logits, grads = _under_cp(model, ids, labels, mesh)
    return _difference(logits, grads, ref_logits, ref_grads)


@pytest.mark.parametrize("mode,floor_scale", [("ulysses", 4), ("zigzag", 4), ("ulysses", 32)])
def test_attention_temperature_counts_from_the_block_start(mode, floor_scale):
    assert run_dist(2, _block_cache, mode, floor_scale, timeout=300) == ["", ""]
