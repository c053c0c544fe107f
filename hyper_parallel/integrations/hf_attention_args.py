"""The keyword arguments a Hugging Face attention module hands its attention function, sorted into
what context-parallel attention implements and what it must refuse.

transformers passes the variant of attention through these keywords (Gemma 2's ``softcap``,
gpt-oss's ``s_aux`` sinks, ``sliding_window``...) and the per-layer plumbing (``position_ids``,
``use_cache``...) through the same ``**kwargs``. An attention function that ignores a keyword it
does not know computes a different attention without a word, so every keyword is either handled
here, known to carry no attention semantics, or a ValueError naming it. A keyword whose value is
``None`` / ``False`` asks for nothing and passes.
"""

# used by the CP attention function itself (hf_context_parallel.CPAttention)
HANDLED = frozenset({"dropout", "scaling", "is_causal", "position_ids", "sliding_window"})

# per-layer plumbing that does not change the attention's value
PLUMBING = frozenset({
    "use_cache", "cache_position", "output_attentions", "output_hidden_states",
    "output_router_logits", "return_dict", "position_embeddings",
})

# what each refused variant is, for the error message
_VARIANTS = {
    "softcap": "logit soft-capping (Gemma 2's attn_logit_softcapping)",
    "s_aux": "attention sinks (gpt-oss's learned per-head sink logits)",
    "sinks": "attention sinks",
    "head_mask": "a head mask",
    "score_mod": "a score modification",
    "block_mask": "a flex-attention block mask",
}


def _asks_nothing(value):
    return value is None or value is False


def check_attention_kwargs(module, kwargs):
    """ValueError for the first keyword that changes the attention and is not implemented."""
    for name, value in kwargs.items():
        if name in HANDLED or name in PLUMBING or _asks_nothing(value):
            continue
        what = _VARIANTS.get(name, "an attention argument context-parallel attention does not implement")
        shown = f"a tensor of shape {tuple(value.shape)}" if hasattr(value, "shape") else repr(value)
        raise ValueError(f"parallelize_model: {type(module).__name__} passes {name}={shown} to its attention "
                         f"({what}); context parallelism does not implement it, and dropping it would train "
                         f"a different model. Use the model without context parallelism, or a config "
                         f"without it")


def check_sliding_window(module, window, total):
    """A window of ``w`` keys changes the attention only when the sequence is longer than ``w``."""
    if window is not None and total > int(window):
        raise ValueError(f"parallelize_model: {type(module).__name__} uses sliding-window attention "
                         f"(sliding_window={window}) on a sequence of {total} tokens; context parallelism "
                         f"does not implement a window shorter than the sequence yet. Train with sequences "
                         f"of at most {window} tokens or without context parallelism")
