"""Tiny random-init Hugging Face causal LMs of the families long-context training uses (the model-zoo
tests). Imported by test workers; transformers is imported inside ``tiny``."""
VOCAB = 64
_BASE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64)
_MLA = dict(_BASE, num_key_value_heads=4, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=8,
            v_head_dim=6, head_dim=4)
_MOE = dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, first_k_dense_replace=1,
            n_group=1, topk_group=1)
_LINEAR = dict(head_dim=8, linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8,
               linear_value_head_dim=8, layer_types=["linear_attention", "full_attention"])

# family -> (config class, model class, config keywords)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", _BASE),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", _BASE),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(_BASE, head_dim=8)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(_BASE, sliding_window=8)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(_BASE, pad_token_id=0)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(_BASE, head_dim=8, attn_logit_softcapping=50.0,
                                                         final_logit_softcapping=None, sliding_window=64)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(_BASE, head_dim=8, sliding_window=8)),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(_BASE, intermediate_size=32, head_dim=8,
                                                         num_local_experts=4, num_experts_per_tok=2,
                                                         sliding_window=64)),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(_BASE, num_key_value_heads=4,
                                                             hidden_dropout=0.0, attention_dropout=0.0)),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(n_embd=32, n_layer=2, n_head=4, vocab_size=VOCAB,
                                                   n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
                                                   attn_pdrop=0.0)),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(_MLA, **_MOE)),
    "deepseek_v32": ("DeepseekV32Config", "DeepseekV32ForCausalLM", dict(_MLA, **_MOE)),
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(
        _BASE, **_LINEAR, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        shared_expert_intermediate_size=16)),
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", dict(_BASE, **_LINEAR)),
    "kimi_linear": ("KimiLinearConfig", "KimiLinearForCausalLM", dict(
        _MLA, pad_token_id=0, bos_token_id=1, eos_token_id=2, linear_head_dim=8, linear_num_heads=4,
        num_experts=4, num_experts_per_token=2, moe_intermediate_size=16,
        layer_types=["linear_attention", "full_attention"])),
}


def tiny(name, **overrides):
    """A fresh fp32 model of family ``name``, the same weights on every call (seeded)."""
    import torch
    import transformers

    config_class, model_class, kwargs = FAMILIES[name]
    config = getattr(transformers, config_class)(**dict(kwargs, **overrides))
    torch.manual_seed(0)
    return getattr(transformers, model_class)(config).float()
