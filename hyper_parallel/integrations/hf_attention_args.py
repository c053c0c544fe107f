"""The keyword arguments a Hugging Face attention module hands its attention function, sorted into
what context-parallel attention implements and what it must refuse.

transformers passes the variant of attention through these keywords (Gemma 2's ``softcap``,
gpt-oss's ``s_aux`` sinks, ``sliding_window``...) and the per-layer plumbing (``position_ids``,
``use_cache``...) through the same ``**kwargs``. An attention function that ignores a keyword it
does not know computes a different attention without a word, so every keyword is either handled
here, known to carry no attention semantics, or a ValueError naming it. A keyword whose value is
``None`` / ``False`` asks for nothing and passes.
"""
from typing import Any

# used by the CP attention function itself (hf_context_parallel.CPAttention); softcap and the sinks
# (gpt-oss's s_aux) go to hyper_parallel.attention through ``attention_variant``
HANDLED = frozenset({"dropout", "scaling", "is_causal", "position_ids", "sliding_window", "softcap", "s_aux",
                     "sinks"})

# per-layer plumbing that does not change the attention's value
PLUMBING = frozenset({
    "use_cache", "cache_position", "output_attentions", "output_hidden_states",
    "output_router_logits", "return_dict", "position_embeddings",
    # the loss's keywords, which transformers hands every layer along with the rest of **kwargs
    "labels", "shift_labels", "num_items_in_batch", "logits_to_keep",
})

# what each refused variant is, for the error message
_VARIANTS = {
    "head_mask": "a head mask",
    "score_mod": "a score modification",
    "block_mask": "a flex-attention block mask",
}


def _asks_nothing(value):
    return value is None or value is False


def check_attention_kwargs(module: Any, kwargs: Any) -> None:
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


def attention_variant(module: Any, kwargs: Any, total: Any) -> Any:
    """(softcap, sinks, window) for ``hyper_parallel.attention`` from the keywords HF passes: Gemma 2's
    ``softcap``, gpt-oss's ``s_aux`` (or ``sinks``) per-head logits, and ``sliding_window`` = w (query
    i sees keys i - w < j <= i, transformers' sliding_window_causal mask). A window at least as long
    as the whole sequence of ``total`` tokens changes nothing and is left out (plain sdpa runs)."""
    sinks = kwargs.get("s_aux")
    if sinks is not None and kwargs.get("sinks") is not None:
        raise ValueError(f"parallelize_model: {type(module).__name__} passes both s_aux and sinks; pass one")
    sinks = kwargs.get("sinks") if sinks is None else sinks
    window = kwargs.get("sliding_window")
    if window is not None and int(window) >= total:
        window = None
    return kwargs.get("softcap"), sinks, None if window is None else int(window)
