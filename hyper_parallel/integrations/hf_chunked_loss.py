"""``parallelize_model(..., loss="chunked")``: the causal LM's loss without its logits.

Given labels, the model's forward runs its decoder, then ``chunked_cross_entropy`` on the final
hidden states and the LM head's weight (a vocab-sharded DTensor under TP): the (tokens × vocab)
logits are never formed, and the returned output has ``loss`` and no ``logits``. Without labels
the forward is the model's own (logits for inference).

Under context parallelism each rank holds a block of the sequence, so the model's own shift of
``labels`` (token t predicts label t + 1 of the same block) is wrong at every block boundary: the
label of a block's last token is on the next rank. There the forward takes only ``shift_labels=``
(shifted on the whole sequence, then ``shard_sequence``'d) and refuses ``labels=`` alone.
``num_items_in_batch=`` (the global count of labels that are not -100) makes each rank's loss its
share of the global mean — summing the ranks' losses gives the single-device loss, as in
transformers' own loss.
"""
from typing import Any
import inspect

import torch.nn.functional as F

from hyper_parallel.core.long_sequence import chunked_cross_entropy
from hyper_parallel.core.long_sequence.chunked_loss import DEFAULT_CHUNK
from hyper_parallel.platform import get_platform

LOSS_OPTIONS = (None, "chunked")
# keywords of the causal LM's forward that belong to the loss or the head, not to the decoder
_LOSS_KEYWORDS = ("labels", "shift_labels", "num_items_in_batch", "ignore_index", "logits_to_keep",
                  "return_dict")


def check_loss_option(loss: Any) -> None:
    if loss not in LOSS_OPTIONS:
        raise ValueError(f"parallelize_model(loss={loss!r}): pass loss='chunked' (the loss in sequence "
                         f"tiles, no logits) or None (the model's own loss)")


def _check_model(model):
    """Refuse heads whose logits are more than ``hidden @ weight.T`` (the chunked loss would differ)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    decoder = getattr(model, getattr(model, "base_model_prefix", ""), None)
    name = type(model).__name__
    if head is None or decoder is None or not hasattr(head, "weight"):
        raise ValueError(f"parallelize_model(loss='chunked'): {name} has no output embedding and base model "
                         f"to split the forward at; use loss=None")
    if getattr(head, "bias", None) is not None:
        raise ValueError(f"parallelize_model(loss='chunked'): {name}'s LM head has a bias, which the chunked "
                         f"loss does not add; use loss=None")
    return head, decoder


def _check_config(model):
    """The config fields known to scale logits (alone on the meta device, where nothing runs)."""
    name = type(model).__name__
    config = getattr(model, "config", None)
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    for attr in ("final_logit_softcapping", "logit_scale", "logits_scaling", "lm_head_multiplier",
                 "output_multiplier_scale", "logit_multiplier"):
        if getattr(config, attr, None) not in (None, 1, 1.0):
            raise ValueError(f"parallelize_model(loss='chunked'): {name} transforms its logits "
                             f"(config.{attr}={getattr(config, attr)!r}); use loss=None")


def probe_logits(model: Any) -> None:
    """Refuse a model whose logits are not ``last hidden state @ lm_head.weight.T``: run it once on a
    short sequence (one process, before any parallelism) and compare. Measures what a list of config
    names would miss: Falcon-H1's lm_head multiplier, Gemma 2's final soft-capping, Cohere's
    logit_scale, a 1/sqrt(d) scaling, a norm applied after the decoder's output. A model on the meta
    device has no values to run: the config check of ``_check_model`` alone applies to it."""
    import torch
    head, decoder = _check_model(model)
    # by name too: a soft-cap of 30 barely shows on a fresh model's small logits, and bites once they grow
    _check_config(model)
    if any(p.is_meta for p in model.parameters()):
        return
    captured = []
    handle = decoder.register_forward_hook(lambda m, a, out: captured.append(
        out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]))
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    ids = torch.randint(0, int(config.vocab_size), (1, 7), generator=torch.Generator().manual_seed(0))
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            logits = model(input_ids=ids.to(head.weight.device), use_cache=False).logits
    finally:
        handle.remove()
        model.train(training)
    hidden = captured[-1] if captured else None
    plain = None if hidden is None else (hidden.float() @ head.weight.float().T)
    if plain is None or plain.shape != logits.shape or not torch.allclose(
            logits.float(), plain, atol=1e-4, rtol=1e-3):
        off = "" if plain is None or plain.shape != logits.shape else \
            f" (largest difference {float((logits.float() - plain).abs().max()):.3g})"
        raise ValueError(f"parallelize_model(loss='chunked'): {type(model).__name__}'s logits are not its "
                         f"last hidden state times the LM head's weight{off}: the model scales, caps or "
                         f"transforms them on the way, which the chunked loss would drop; use loss=None")


def apply_chunked_loss(model: Any, context_parallel: Any, chunk_size: Any = DEFAULT_CHUNK) -> Any:
    """Route ``model``'s forward through the chunked loss when it is given labels. The head and the
    decoder are looked up at each call: resize_token_embeddings or a new lm_head after wrapping count."""
    _check_model(model)

    def make_wrapper(original: Any) -> Any:
        signature = inspect.signature(original)
        var_keyword = [p.name for p in signature.parameters.values() if p.kind is p.VAR_KEYWORD]

        def forward(*args: Any, **kwargs: Any) -> Any:
            arguments = dict(signature.bind_partial(*args, **kwargs).arguments)
            for name in var_keyword:      # the forward's **kwargs, flattened into the other arguments
                arguments.update(arguments.pop(name, {}))
            if arguments.get("labels") is None and arguments.get("shift_labels") is None:
                return original(*args, **kwargs)
            head, decoder = _check_model(model)
            return _loss_forward(model, head, decoder, arguments, context_parallel, chunk_size)
        return forward
    get_platform().replace_forward(model, make_wrapper)
    return model


def _shifted_labels(arguments, context_parallel, ignore_index):
    shift_labels, labels = arguments.get("shift_labels"), arguments.get("labels")
    if shift_labels is not None:
        return shift_labels
    if context_parallel:
        raise ValueError("under context parallelism the model cannot shift labels= itself (the next token "
                         "of a rank's last token is on the next rank); shift on the whole sequence, "
                         "shard_sequence the result and pass it as shift_labels= (with num_items_in_batch= "
                         "the global count of labels != -100, so the ranks' losses add up to the global "
                         "mean)")
    # the model's own shift: token t predicts label t + 1, the last token nothing
    return F.pad(labels[..., 1:], (0, 1), value=ignore_index)


def _loss_forward(model, head, decoder, arguments, context_parallel, chunk_size):
    from transformers.modeling_outputs import CausalLMOutputWithPast
    ignore_index = arguments.get("ignore_index", -100)
    keep = arguments.get("logits_to_keep", 0)
    if not (isinstance(keep, int) and keep == 0):
        raise ValueError(f"loss='chunked' computes the loss of every position; logits_to_keep={keep!r} is "
                         f"for generation: drop it (or call without labels)")
    shift_labels = _shifted_labels(arguments, context_parallel, ignore_index)
    count = arguments.get("num_items_in_batch")
    decoder_kwargs = {k: v for k, v in arguments.items() if k not in _LOSS_KEYWORDS}
    outputs = decoder(**decoder_kwargs)
    hidden = outputs.last_hidden_state if hasattr(outputs, "last_hidden_state") else outputs[0]
    reduction = "mean" if count is None else "sum"
    loss = chunked_cross_entropy(hidden, head.weight, shift_labels.to(hidden.device), chunk_size=chunk_size,
                                 ignore_index=ignore_index, reduction=reduction)
    if count is not None:
        loss = loss / (count.to(loss.device) if hasattr(count, "to") else count)
    output = CausalLMOutputWithPast(loss=loss, logits=None,
                                    hidden_states=getattr(outputs, "hidden_states", None),
                                    attentions=getattr(outputs, "attentions", None))
    return output.to_tuple() if arguments.get("return_dict") is False else output
