"""Built-in models from their published configs (no download), or any Hugging Face config.json.

Like integrations/, plan/ may import transformers (to build a model from its config class); it
never imports torch (the dry run's torch side lives in platform/torch/dry_run*.py). The numbers
are those of the published config.json files.
"""
import json
import os
from typing import Callable, Dict, Optional, Tuple

_LLAMA31_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                 "original_max_position_embeddings": 8192, "rope_theta": 500000.0}
_LLAMA31 = dict(vocab_size=128256, max_position_embeddings=131072, rope_parameters=_LLAMA31_ROPE,
                num_key_value_heads=8, rms_norm_eps=1e-5, tie_word_embeddings=False)

_QWEN3_MOE = dict(num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                  norm_topk_prob=True, vocab_size=151936, max_position_embeddings=40960,
                  tie_word_embeddings=False,
                  rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})

# name -> (config class, model class, keywords)
BUILTIN: Dict[str, Tuple[str, str, dict]] = {
    "llama3.1-8b": ("LlamaConfig", "LlamaForCausalLM", dict(
        _LLAMA31, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32)),
    "llama3.1-70b": ("LlamaConfig", "LlamaForCausalLM", dict(
        _LLAMA31, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64)),
    "llama3.1-405b": ("LlamaConfig", "LlamaForCausalLM", dict(
        _LLAMA31, hidden_size=16384, intermediate_size=53248, num_hidden_layers=126,
        num_attention_heads=128)),
    "qwen3-32b": ("Qwen3Config", "Qwen3ForCausalLM", dict(
        hidden_size=5120, intermediate_size=25600, num_hidden_layers=64, num_attention_heads=64,
        num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, tie_word_embeddings=False)),
    "mistral-7b": ("MistralConfig", "MistralForCausalLM", dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=32768, max_position_embeddings=32768, sliding_window=None,
        rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    "mixtral-8x7b": ("MixtralConfig", "MixtralForCausalLM", dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2, vocab_size=32000,
        max_position_embeddings=32768, sliding_window=None, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    "mixtral-8x22b": ("MixtralConfig", "MixtralForCausalLM", dict(
        hidden_size=6144, intermediate_size=16384, num_hidden_layers=56, num_attention_heads=48,
        num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2, vocab_size=32768,
        max_position_embeddings=65536, sliding_window=None, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    "qwen3-30b-a3b": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        _QWEN3_MOE, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
        num_attention_heads=32)),
    "qwen3-235b-a22b": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        _QWEN3_MOE, hidden_size=4096, intermediate_size=12288, moe_intermediate_size=1536,
        num_hidden_layers=94, num_attention_heads=64)),
    "gemma3-27b": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        hidden_size=5376, intermediate_size=21504, num_hidden_layers=62, num_attention_heads=32,
        num_key_value_heads=16, head_dim=128, vocab_size=262208, sliding_window=1024,
        query_pre_attn_scalar=168, max_position_embeddings=131072)),
    "gpt-oss-120b": ("GptOssConfig", "GptOssForCausalLM", dict(
        hidden_size=2880, intermediate_size=2880, num_hidden_layers=36, num_attention_heads=64,
        num_key_value_heads=8, head_dim=64, num_local_experts=128, num_experts_per_tok=4,
        vocab_size=201088, sliding_window=128, max_position_embeddings=131072)),
    "deepseek-v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61,
        num_attention_heads=128, num_key_value_heads=128, n_routed_experts=256, n_shared_experts=1,
        num_experts_per_tok=8, first_k_dense_replace=3, q_lora_rank=1536, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, vocab_size=129280, n_group=8,
        topk_group=4, routed_scaling_factor=2.5, max_position_embeddings=163840)),
    "qwen3-next-80b": ("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(
        hidden_size=2048, intermediate_size=5120, num_hidden_layers=48, num_attention_heads=16,
        num_key_value_heads=2, head_dim=256, num_experts=512, num_experts_per_tok=10,
        moe_intermediate_size=512, shared_expert_intermediate_size=512, vocab_size=151936,
        linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_conv_kernel_dim=4, full_attention_interval=4,
        max_position_embeddings=262144)),
    "kimi-linear-48b": ("KimiLinearConfig", "KimiLinearForCausalLM", dict(
        hidden_size=2304, intermediate_size=9216, moe_intermediate_size=1024, num_hidden_layers=27,
        num_attention_heads=32, num_key_value_heads=32, head_dim=72, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, num_experts=256,
        num_experts_per_token=8, num_shared_experts=1, first_k_dense_replace=1, vocab_size=163840,
        linear_head_dim=128, linear_num_heads=32, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        # published full_attn_layers [4, 8, ..., 24, 27] (1-based): the last layer is full attention
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 6 + ["linear_attention"] * 2
        + ["full_attention"],
        max_position_embeddings=1048576)),
}


# Llama 3 names: the 3.1 models (the same architecture with the 128k-token RoPE scaling)
ALIASES = {"llama3-8b": "llama3.1-8b", "llama3-70b": "llama3.1-70b", "llama3-405b": "llama3.1-405b"}


def _layer_period(config) -> int:
    """The repeat length of a hybrid stack (sliding/full, linear/full): layers are cut in whole periods.
    A stack whose last, partial period breaks the pattern (Kimi-Linear's final full-attention layer)
    takes the pattern's period (scaling.py's linear extension then approximates that tail)."""
    types = getattr(config, "layer_types", None)
    if not types:
        return 1
    for period in range(1, len(types) // 2 + 1):
        whole = len(types) - len(types) % period     # the tail after the last whole period is free
        if all(types[i] == types[i % period] for i in range(whole)):
            return period
    return len(types)


def load_config(name_or_path: str, dtype: str = "bfloat16"):
    """(transformers config, model class) of a built-in name or a config.json path."""
    import transformers
    name_or_path = ALIASES.get(name_or_path, name_or_path)
    if name_or_path in BUILTIN:
        config_class, model_class, kwargs = BUILTIN[name_or_path]
        config = getattr(transformers, config_class)(**kwargs)
    elif os.path.isfile(name_or_path):
        with open(name_or_path) as f:
            data = json.load(f)
        model_type = data.get("model_type")
        if model_type is None:
            raise ValueError(f"{name_or_path}: a Hugging Face config.json names its model_type")
        config = transformers.AutoConfig.for_model(**data)
        model_class = None
    else:
        raise ValueError(f"model {name_or_path!r} is neither a built-in ({', '.join(sorted(BUILTIN))}) nor a "
                         f"config.json file")
    config.dtype = dtype
    config.use_cache = False
    for key in ("attention_dropout", "hidden_dropout"):
        if hasattr(config, key):
            setattr(config, key, 0.0)
    return config, model_class


def model_fn(name_or_path: str, layers: Optional[int] = None,
             dtype: str = "bfloat16") -> Tuple[Callable, int]:
    """(a function building the model, its layer count). ``layers``: build that many whole periods of
    the layer pattern's worth of layers instead (for per-layer scaling; see search.py)."""
    import copy
    import transformers
    config, model_class = load_config(name_or_path, dtype)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    total = int(text.num_hidden_layers)
    if layers is not None:
        config = copy.deepcopy(config)
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        text.num_hidden_layers = layers
        if getattr(text, "layer_types", None):
            text.layer_types = list(text.layer_types[:layers])
        for key in ("first_k_dense_replace",):
            if getattr(text, key, None):
                setattr(text, key, min(getattr(text, key), max(0, layers - 1)))

    cls = getattr(transformers, model_class) if model_class else transformers.AutoModelForCausalLM

    def build():
        # transformers takes the dtype by name; the model is built wherever the caller is (meta)
        return cls._from_config(config, dtype=dtype) if model_class else cls.from_config(config, dtype=dtype)
    return build, total


def layer_period(name_or_path: str) -> int:
    config, _ = load_config(name_or_path)
    return _layer_period(config.get_text_config() if hasattr(config, "get_text_config") else config)
