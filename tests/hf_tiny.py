"""Tiny random configs of every causal-LM type transformers registers (used by tests/hf_sweep.py).

``tiny(model_type)`` shrinks the config class's defaults: hidden 32, 4 heads of 8, vocabulary 128, one
layer of each distinct layer (layer type, per-layer list entry, per-layer config) or 2, every window and
chunk 5 (shorter than the sweep's 16-token sequence), dropout 0. Sizes that depend on each other are
derived, not set: 2 key/value heads (as many as the heads in latent attention, or where the config leaves
them None), rotary and latent-attention dims keep their share of the head, Mamba heads cover
``expand * hidden``, every list, set or mapping indexed by layer follows the layers kept. Nested configs
(text, vision, audio, decoder ...) are shrunk the same way; where the causal-LM class takes one of them
(Llama 4, Qwen3.5, MusicGen), that is the config returned. ``_TYPE_OVERRIDES`` is the last resort, for
what no rule derives (a default that cannot build its own model, a type-specific constraint), each with why.
"""
import math

VOCAB = 128
WINDOW = 5
HIDDEN, HEADS, HEAD_DIM = 32, 4, 8
ROPE_TYPES = {"default": {}, "linear": {"factor": 2.0}, "dynamic": {"factor": 2.0},
              "yarn": {"factor": 2.0, "original_max_position_embeddings": 8},
              "longrope": None,   # per-dim factors: built in _rope
              "llama3": {"factor": 2.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8}}

_HIDDEN = ("hidden_size", "d_model", "n_embd", "hidden_dim", "dim", "embed_dim", "model_dim", "d_embed",
           "word_embed_proj_dim", "embedding_size", "emb_dim", "ple_embed_dim", "backbone_hidden_size",
           "hidden_size_global", "adapter_in_dim", "adapter_input_size", "adapter_out_dim",
           "ext_pw_out_channel", "depthwise_separable_out_channel", "nemo_conv_channels")   # (Phi-4 audio)
_HEADS = ("num_attention_heads", "n_head", "num_heads", "decoder_attention_heads", "encoder_attention_heads",
          "n_heads", "swa_num_attention_heads", "linear_num_heads")
_KV_HEADS = ("num_key_value_heads", "n_kv_heads", "num_kv_heads", "multi_query_group_num",
             "swa_num_key_value_heads")
_EXPERTS = ("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts")
_TOP_K = ("num_experts_per_tok", "moe_top_k", "num_experts_per_token", "top_k", "moe_k")
_MLA = ("qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "kv_lora_rank", "q_lora_rank", "head_dim",
        "qk_head_dim", "o_lora_rank")
_LAYERS = ("num_hidden_layers", "n_layer", "num_layers", "decoder_layers", "encoder_layers", "n_layers",
           "num_blocks")
_SIZES = [
    (_HIDDEN, HIDDEN),
    (("intermediate_size", "ffn_dim", "d_ff", "n_inner", "decoder_ffn_dim", "encoder_ffn_dim",
      "ffn_hidden_size", "intermediate_size_mlp", "inner_hidden_size", "hidden_ff_size", "feed_forward_size",
      "mlp_only_intermediate_size", "pronunciation_embed_dim", "shape_embed_dim", "dff", "dim_ff"),
     64),
    (("moe_intermediate_size", "shared_expert_intermediate_size", "expert_intermediate_size",
      "shared_intermediate_size", "router_hidden_size", "hc_lowrank", "expert_ffn_hidden_size"), 16),
    (_HEADS, HEADS),
    (("head_dim", "kv_channels", "attention_head_dim", "attention_head_size", "swa_head_dim",
      "linear_key_head_dim", "linear_value_head_dim", "linear_head_dim", "mamba_d_head", "index_head_dim",
      "v_head_dim"),
     HEAD_DIM),
    (("linear_num_key_heads", "index_num_heads", "heads_per_ngram"), 2),
    (("linear_num_value_heads",), 4),
    (("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "seq_length"), 256),
    (_EXPERTS, 4),
    (_TOP_K, 2),
    (("sliding_window", "attention_chunk_size", "window_size", "local_window_size", "sliding_window_size",
      "local_attention_window_len"), WINDOW),
    (("mamba_d_state", "state_size", "d_state", "ssm_state_size"), 16),
    (("mamba_dt_rank", "time_step_rank", "dt_rank"), HIDDEN // 16),   # as "auto" derives it
    (("index_topk", "index_pool_size"), 8), (("index_compression",), 4),
    (("num_codebooks",), 1),   # MusicGen reads rows as (batch x codebooks): one, so a row is a sequence
    (("num_centroids",), 8), (("centroid_intermediate_top_k",), 2),   # Gemma 4 assistant: 16 ids each
]
_ZERO = ("dropout", "dropout_rate", "attention_dropout", "hidden_dropout", "attn_pdrop", "resid_pdrop",
         "embd_pdrop", "hidden_dropout_prob", "attention_probs_dropout_prob", "activation_dropout",
         "classifier_dropout", "layerdrop", "decoder_layerdrop", "encoder_layerdrop",
         "attention_dropout_prob")
_TOKENS = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id", "sep_token_id",
           "cls_token_id", "mask_token_id", "unk_token_id", "unk_index", "mask_index")
# switched on where the config has them, so the tiny model still has a window / a no-rope layer ...
_FLAGS = {"use_sliding_window": True, "max_window_layers": 1, "floor_scale": 4, "no_rope_layer_interval": 2,
          "attn_temperature_tuning": True, "first_k_dense_replace": 1, "num_dense_layers": 1}
DROP = object()   # an override that removes the field (the config derives it again)
# The last resort: fields no rule above derives, each with the reason.
_TYPE_OVERRIDES = {
    "zaya": {"num_experts_per_tok": 1},                    # ZAYA supports top-1 routing only
    "kolibri1_1": {"head_dim": 16},                        # NVFP4 key/value rounding: multiples of 16
    # its validator wants a text model without per-layer inputs or MoE blocks
    "gemma4_assistant": {"text_config": {"hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": 0,
                                         "enable_moe_block": False}},
    "xmod": {"default_language": "en_XX"},                 # adapters are chosen by language
    # no default layer_types (checkpoints list them), which the model indexes: a conv and an attention layer
    "lfm2_moe": {"layer_types": ["conv", "full_attention"]},
    # no default rope parameters, which the model reads per layer type: a window and a full layer
    "cohere_compass_text": {"layer_types": ["sliding_attention", "full_attention"], "rope_parameters": {
        t: {"rope_type": "default", "rope_theta": 10000.0} for t in ("sliding_attention", "full_attention")}},
    # its attention reads attn_config.rope_theta, a field the attention config class does not define
    "dbrx": {"attn_config": {"rope_theta": 10000.0, "clip_qkv": 8.0}},   # (and clamps to clip_qkv)
    # a shared transformer block tied across the hybrid layers: two of them
    "zamba": {"num_hidden_layers": 3, "layers_block_type": ["linear_attention", "hybrid", "hybrid"]},
    # LSH and local attention need the sequence (16) a multiple of the chunk and the axial shape's product;
    # the axial embedding dims sum to the hidden size (their default ratio 1:3); hashing seeded
    "reformer": {"is_decoder": True, "axial_pos_shape": [4, 4], "axial_pos_embds_dim": [8, 24],
                 "local_attn_chunk_length": 4,
                 "lsh_attn_chunk_length": 4, "num_buckets": 4, "hash_seed": 0},   # (and asserts is_decoder)
    # no default QSA indexer sizes, which its indexed layers read: a budget of 8 of 16 tokens, in blocks of 4
    "qwen4_exp_text": {"indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 8,
                       "indexer_budget": 8, "indexer_compress_ratio": 4},
    # to_dict writes (attention, mlp) pairs and doubled counts; input + recurrent + output layers must sum
    "dory": {"num_hidden_layers": 4, "n_input_layers": 1, "n_output_layers": 1, "layer_types": DROP},
}


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _first(defaults: dict, names: tuple) -> str | None:
    return next((n for n in names if _is_int(defaults.get(n))), None)


def _sizes(defaults: dict) -> dict:
    """Every size the tables name, the dropouts, the special token ids, the flags."""
    out = {}
    defaults = {k: v for k, v in defaults.items() if isinstance(k, str)}   # not id2label's ids
    for names, size in _SIZES:
        out.update((n, size) for n in names if _is_int(defaults.get(n)) and defaults[n] > 0)
    out.update((n, WINDOW) for n in ("sliding_window", "attention_chunk_size") if n in defaults)   # None too
    out.update((n, 16 if any(w in n for w in ("moe", "expert", "shared")) else 64)   # (Ergo's first dense)
               for n, v in defaults.items()
               if "intermediate_size" in n and _is_int(v) and v > 64 and n not in out)
    out.update((n, VOCAB) for n, v in defaults.items()
               if "vocab" in n and _is_int(v) and v > VOCAB)   # per-layer, shape, n-gram, hash vocabularies
    out.update((n, i % 16) for i, n in enumerate(_TOKENS)
               if _is_int(defaults.get(n)) and defaults[n] >= VOCAB)
    out.update((n, 0.0) for n, v in defaults.items()   # every dropout: the two runs must not draw
               if isinstance(v, float) and (n in _ZERO or "dropout" in n or "pdrop" in n))
    out.update((n, v) for n, v in _FLAGS.items() if n in defaults and type(defaults[n]) is type(v))
    if isinstance(defaults.get("initializer_range"), float):
        out["initializer_range"] = 0.2
    if _is_int(defaults.get("hidden_size_per_layer_input")) and defaults["hidden_size_per_layer_input"] > 0:
        out["hidden_size_per_layer_input"] = HEAD_DIM
    return out


def _share(value: int, whole: int, new_whole: int, least: int = 2) -> int:
    """``value``'s share of ``whole`` applied to ``new_whole`` (even, at least ``least``)."""
    return max(least, 2 * round(value * new_whole / whole / 2))


def _derived(defaults: dict, out: dict) -> None:
    """Sizes that must agree with others: kept at their default relation to the shrunk ones."""
    heads = _first(defaults, _HEADS)
    if "head_dim" in defaults and defaults["head_dim"] is None and heads:   # read without a fallback
        out["head_dim"] = HEAD_DIM
    for name in _KV_HEADS:
        if name in defaults and defaults[name] is None and heads:   # None: as many as the heads
            out[name] = HEADS
        if _is_int(defaults.get(name)) and defaults[name] > 0:   # grouped, but latent attention's equal
            out[name] = HEADS if _is_int(defaults.get("qk_rope_head_dim")) else 2
    hidden = _first(defaults, _HIDDEN)
    if _is_int(defaults.get("attention_hidden_size")) and hidden:   # Zamba's twice, RWKV's once the hidden
        out["attention_hidden_size"] = HIDDEN * defaults["attention_hidden_size"] // defaults[hidden]
    old_head = defaults.get("head_dim") if _is_int(defaults.get("head_dim")) else None
    if old_head is None and hidden and heads:
        old_head = defaults[hidden] // defaults[heads]
    if _is_int(defaults.get("rotary_dim")) and old_head:   # GPT-J, CodeGen: a share of the head
        out["rotary_dim"] = _share(defaults["rotary_dim"], old_head, out.get("head_dim", HEAD_DIM), 4)
    if _is_int(defaults.get("qk_rope_head_dim")):   # multi-head latent attention: every dim / one factor
        unit = defaults["qk_rope_head_dim"] / 4   # (the rope part 4, DeepSeek-V3's others 8, 8, 32, 96)
        out.update((n, max(2, round(defaults[n] / unit))) for n in _MLA if _is_int(defaults.get(n)))
    if "moe_intermediate_size" in defaults:   # a mixture of experts whose counts default to None
        for names, size in ((_EXPERTS, 4), (_TOP_K, 2), (("n_shared_experts",), 1)):
            out.update((n, size) for n in names if n in defaults and defaults[n] is None)
    for expand, n_heads, d_head in (("mamba_expand", "mamba_n_heads", "mamba_d_head"),
                                    ("expand", "num_heads", "head_dim")):
        if all(_is_int(defaults.get(n)) for n in (expand, n_heads, d_head)) and (
                n_heads.startswith("mamba") or "state_size" in defaults):
            # Mamba-2: heads * head dim == expand * hidden
            out[d_head] = HEAD_DIM
            out[n_heads] = defaults[expand] * HIDDEN // HEAD_DIM
            if _is_int(defaults.get("mamba_d_ssm")):   # Falcon-H1: the SSM width is heads x head dim
                out["mamba_d_ssm"] = out[n_heads] * HEAD_DIM
    for groups, n_heads in (("mamba_n_groups", "mamba_n_heads"), ("n_groups", "num_heads")):
        if _is_int(defaults.get(groups)) and n_heads in out:
            out[groups] = math.gcd(defaults[groups], out[n_heads])
    for group in ("n_group", "num_expert_group"):
        if _is_int(defaults.get(group)) and defaults[group] > 1:   # grouped routing: 2 groups of 2
            out[group], out["topk_group"] = 2, 1
    for name in ("n_mamba_heads",):
        if _is_int(defaults.get(name)):
            out[name] = min(defaults[name], 2)


def _per_layer(defaults: dict, n: int) -> tuple:
    """The fields indexed by layer: lists of length ``n``, {layer: config} mappings, sets of layer ids."""
    sets = [k for k, v in defaults.items() if isinstance(v, (list, tuple)) and 0 < len(v) <= n
            and all(_is_int(i) and 0 <= i < n for i in v) and list(v) == sorted(set(v))
            and (len(v) < n or n > 2) and ("layer" in k or "idx" in k)]   # Llama 4's moe_layers: all
    lists = [k for k, v in defaults.items() if isinstance(v, (list, tuple)) and len(v) == n
             and k != "architectures" and k not in sets]
    maps = [k for k, v in defaults.items() if isinstance(v, dict) and v
            and all(str(i).isdigit() and int(i) < n and isinstance(e, dict) for i, e in v.items())]
    refs = [k for k in lists if all(_is_int(v) and 0 <= v <= i for i, v in enumerate(defaults[k]))
            and any(v != i for i, v in enumerate(defaults[k]))]   # Kolibri's kv_source_layers
    return [k for k in lists if k not in refs], maps, sets, refs


def _tail(defaults: dict, n: int) -> set:
    """The last layers that reuse earlier layers' keys and values (Gemma 3n's num_kv_shared_layers)."""
    shared = defaults.get("num_kv_shared_layers")
    return set(range(n - shared, n)) if _is_int(shared) else set()


def _scaled(entry: dict, defaults: dict, out: dict) -> dict:
    """One layer's own config: its sizes at their ratio to the model-wide ones."""
    shrunk = _sizes(entry)
    _derived(entry, shrunk)
    for name, value in entry.items():
        if _is_int(value) and _is_int(defaults.get(name)) and name in out and defaults[name]:
            shrunk[name] = max(1, out[name] * value // defaults[name])
    return dict(entry, **shrunk)


def _layers(defaults: dict, out: dict, derived: set) -> None:
    """Keep the first layer of each distinct kind (at least 2); every per-layer field follows. A list of
    one kind that the config derives (``derived``: fields without a default) is dropped: it is derived
    again from the shrunk sizes and flags (Qwen2's windows from ``max_window_layers``)."""
    name = _first(defaults, _LAYERS)
    if name is None or defaults[name] < 2:
        return
    n = defaults[name]
    lists, maps, sets, refs = _per_layer(defaults, n)
    tail = _tail(defaults, n)

    def kind(i: int) -> tuple:
        per_map = tuple(repr({str(k).lstrip("0") or "0": v for k, v in defaults[m].items()}.get(str(i)))
                        for m in maps)
        return (tuple(repr(defaults[k][i]) for k in lists) + per_map + tuple(i in defaults[s] for s in sets)
                + tuple(defaults[k][i] == i for k in refs) + (i in tail,))
    kinds = {}
    for i in range(n):
        kinds.setdefault(kind(i), i)
    kept = set(kinds.values())
    kept |= {defaults[k][i] for k in refs for i in kept}   # and the layers they read from
    kept = sorted(kept | set([i for i in range(n) if i not in kept][:max(0, 2 - len(kept))]))
    if tail:
        out["num_kv_shared_layers"] = len(tail.intersection(kept))
    for k in refs:
        out[k] = [kept.index(defaults[k][i]) for i in kept]
    for layers in _LAYERS:
        if _is_int(defaults.get(layers)):
            out[layers] = len(kept) if defaults[layers] == n else 2
    size_of = {n: size for names, size in _SIZES for n in names}
    for k in lists:
        values = [defaults[k][i] for i in kept]
        if k in derived and len(set(map(repr, values))) == 1:
            out[k] = DROP
            continue
        out[k] = [size_of[k] if k in size_of and _is_int(v) else v for v in values]
    for k in maps:
        entries = {int(i): v for i, v in defaults[k].items()}
        width = max(len(str(i)) for i in defaults[k])
        out[k] = {f"{kept.index(i):0{width}d}" if isinstance(next(iter(defaults[k])), str) else kept.index(i):
                  _scaled(v, defaults, out) if isinstance(v, dict) else v
                  for i, v in entries.items() if i in kept}
    for k in sets:
        out[k] = [kept.index(i) for i in defaults[k] if i in kept]


def _derived_fields(config_class: type) -> set:
    """The fields a config derives when not given: no default, or None."""
    import dataclasses
    if not dataclasses.is_dataclass(config_class):
        return set()
    return {f.name for f in dataclasses.fields(config_class) if f.default is None}


def _merge(defaults: dict, out: dict) -> dict:
    return {k: v for k, v in dict(defaults, **out).items() if v is not DROP}


def _overrides(defaults: dict, config_class: type) -> dict:
    """Keyword arguments that shrink a config whose defaults are ``defaults`` (a dict), nested ones too."""
    from transformers import CONFIG_MAPPING
    out = _sizes(defaults)
    _derived(defaults, out)
    _layers(defaults, out, _derived_fields(config_class))
    subs = getattr(config_class, "sub_configs", {})
    for key, sub in defaults.items():   # text, vision, audio, decoder ... configs
        if isinstance(sub, dict) and "model_type" in sub:
            sub_class = CONFIG_MAPPING.get(sub["model_type"], subs.get(key))
            out[key] = _merge(sub, _overrides(sub, sub_class))
        elif isinstance(sub, dict) and key not in out and _sizes(sub):   # Kimi's linear_attn_config
            shrunk = _sizes(sub)
            _derived(sub, shrunk)
            out[key] = dict(sub, **shrunk)
    for key, value in _TYPE_OVERRIDES.get(getattr(config_class, "model_type", ""), {}).items():
        out[key] = _merge(out[key], value) if isinstance(out.get(key), dict) else value
    return out


def _defaults(config_class: type) -> dict:
    """The config class's defaults as a dict; its sub-configs' where the defaults do not validate."""
    import dataclasses

    from transformers import CONFIG_MAPPING
    try:
        return config_class().to_dict()
    except Exception:   # the fields' defaults, and each sub-config's
        out = {f.name: f.default for f in dataclasses.fields(config_class)
               if f.default is not dataclasses.MISSING}
        specs = getattr(config_class, "sub_configs_defaults", {})
        for key, sub_class in getattr(config_class, "sub_configs", {}).items():
            sub_class = CONFIG_MAPPING[specs[key].model_type] if key in specs else sub_class
            out[key] = dict(sub_class().to_dict(), model_type=sub_class.model_type)
        return out


def text_config(config: object) -> object:
    """The config the token ids meet: the decoder's where there are several text configs."""
    if not hasattr(config, "get_text_config"):
        return config
    try:
        return config.get_text_config(decoder=True)
    except ValueError:
        return getattr(config, "decoder", config)


def _rope(config: object, rope_type: str) -> object:
    params = getattr(config, "rope_parameters", None)
    if rope_type == "default":
        return config
    if not isinstance(params, dict) or "rope_type" not in params:
        return None
    extra = ROPE_TYPES[rope_type]
    if extra is None:   # longrope: a factor per rotary frequency, the long ones past the original length
        head_dim = getattr(config, "head_dim", None) or (
            getattr(config, "hidden_size", 0) // getattr(config, "num_attention_heads", 1))
        if not head_dim:   # (BLT's top config: its sizes live in its sub-configs)
            return None
        dim = int(params.get("partial_rotary_factor", 1.0) * head_dim)
        extra = {"short_factor": [1.0] * (dim // 2), "long_factor": [2.0 + i for i in range(dim // 2)],
                 "original_max_position_embeddings": 8}
    config.rope_parameters = dict(params, rope_type=rope_type, **extra)
    return config


def tiny(model_type: str, rope_type: str = "default") -> tuple:
    """(config, model class) of a tiny random ``model_type``, (None, None) where the config takes no
    ``rope_type``; raises when the config does not build."""
    import transformers
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    config_class = CONFIG_MAPPING[model_type]
    out = _overrides(_defaults(config_class), config_class)
    config = config_class(**{k: v for k, v in out.items() if v is not DROP})
    model_class = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])
    if not isinstance(config, model_class.config_class):   # Llama 4, Qwen3.5, MusicGen: a text model
        config = next((c for c in map(config.__dict__.get, getattr(config, "sub_configs", {}))
                       if isinstance(c, model_class.config_class)), config)
    if _rope(text_config(config), rope_type) is None:
        return None, None
    return config, model_class


def rope_types(model_type: str) -> list:
    """The rope types ``model_type``'s text config takes (only "default" where it has no rope_type)."""
    config, _ = tiny(model_type)
    params = getattr(text_config(config), "rope_parameters", None)
    return list(ROPE_TYPES) if isinstance(params, dict) and "rope_type" in params else ["default"]
