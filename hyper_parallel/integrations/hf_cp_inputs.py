"""What a Hugging Face model's forward is called with under context parallelism, read and checked per forward.

Each rank holds a block of the sequence, so the inputs are taken apart before the model runs: this rank's
batch, block length and positions (``local_inputs``), one fixed-size exchange in which every rank learns
every rank's (``check_ranks_agree``), and the global padding / document masks built from the gathered
blocks (``global_masks``). Calls that would compute something else than the model on the whole sequence
raise a ValueError on every rank: a pooled output (no sequence dim) or ``logits_to_keep``, the model's
attention implementation switched away after wrapping, ranks in different forwards or grad modes.
"""
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from hyper_parallel.platform import get_platform


def local_inputs(mesh: Any, args: Any, kwargs: Dict[str, Any]) -> Tuple[int, int, torch.Tensor]:
    """This rank's (batch, block length, position ids); ValueError for inputs CP cannot take."""
    if len(args) > 1:
        raise ValueError("parallelize_model: under context parallelism call the model with keyword "
                         "arguments (input_ids=..., attention_mask=..., position_ids=...)")
    for name in ("past_key_values", "cache"):
        if kwargs.get(name) is not None:
            raise ValueError("parallelize_model: KV caches are not supported under context parallelism "
                             "(each rank holds a block of the sequence); use the model for training")
    keep = kwargs.get("logits_to_keep")
    if keep is not None and not (isinstance(keep, int) and keep == 0):
        raise ValueError(f"parallelize_model: logits_to_keep={keep!r} under context parallelism would keep "
                         f"each rank's own last tokens, not the sequence's; leave it 0 (all logits) and "
                         f"select after gathering")
    _check_labels(kwargs)
    first = args[0] if args else kwargs.get("input_ids")
    first = kwargs.get("inputs_embeds") if first is None else first
    if first is None:
        raise ValueError("parallelize_model: the model was called without input_ids or inputs_embeds")
    batch, local = int(first.shape[0]), int(first.shape[1])
    mask = kwargs.get("attention_mask")
    if mask is not None and (mask.ndim != 2 or tuple(mask.shape) != (batch, local)):
        raise ValueError(f"parallelize_model: attention_mask of shape {tuple(mask.shape)} is not "
                         f"supported under context parallelism; pass the 2-D padding mask's block "
                         f"({batch}, {local}) from shard_sequence")
    return batch, local, _positions(mesh, kwargs.get("position_ids"), batch, local)


def _check_labels(kwargs: Dict[str, Any]) -> None:
    """The model's own loss under CP: labels shifted on the whole sequence (the next token of a rank's
    last one is on the next rank) and the global count of labelled tokens (each rank's mean would
    weigh the ranks' blocks equally)."""
    if kwargs.get("labels") is not None and kwargs.get("shift_labels") is None:
        raise ValueError("parallelize_model: labels= under context parallelism would be shifted on each "
                         "rank's block (the next token of a rank's last token is on the next rank); shift "
                         "on the whole sequence, shard_sequence the result and pass it as shift_labels=")
    if kwargs.get("shift_labels") is not None and kwargs.get("num_items_in_batch") is None:
        raise ValueError("parallelize_model: shift_labels= under context parallelism needs "
                         "num_items_in_batch= (the global count of labels != -100), so that the ranks' "
                         "losses add up to the global mean instead of averaging per-rank means")


def _positions(mesh: Any, positions: Optional[torch.Tensor], batch: int, local: int) -> torch.Tensor:
    if positions is None:
        start = mesh.get_local_rank() * local
        return torch.arange(start, start + local).unsqueeze(0)
    if positions.ndim != 2 or positions.shape[-1] != local or positions.shape[0] not in (1, batch):
        raise ValueError(f"parallelize_model: position_ids of shape {tuple(positions.shape)} must be "
                         f"this rank's block ({batch} or 1, {local}) of the global positions "
                         f"(shard_sequence)")
    return positions


def check_ranks_agree(mesh: Any, module: torch.nn.Module, row: list, problem: Optional[Exception]) -> None:
    """Every rank learns every rank's ``row`` (batch, block length, which inputs, grad mode, forward count)
    and whether its inputs were refused, in one fixed-size all-gather, before the gathers whose sizes
    depend on them: a rank with 63 tokens, another batch size, an extra forward or another grad mode is a
    ValueError on every rank, not a collective that aborts, hangs or pairs two different forwards."""
    device = next(module.parameters()).device
    row = row + [int(problem is not None)]
    mine = torch.tensor([row], dtype=torch.int64, device=device)
    every = get_platform().all_gather(mine, mesh.get_group(), dim=0)
    # a dry run (hyper_parallel.plan) is one rank on fake tensors: agreement is assumed
    every = [row] * mesh.size() if get_platform().is_fake(every) else every.cpu().tolist()
    if problem is not None:
        raise problem
    refused = [r for r, seen in enumerate(every) if seen[-1]]
    if refused:
        raise ValueError(f"parallelize_model: CP rank(s) {refused} refused their inputs (their error "
                         f"says why); every rank stops before the sequence collectives")
    if any(seen != every[0] for seen in every):
        calls = {r: f"batch {s[0]}, {s[1]} tokens, attention_mask {bool(s[2])}, position_ids {bool(s[3])}, "
                    f"grad mode {bool(s[4])}, forward #{s[5]}" for r, s in enumerate(every)}
        raise ValueError(f"parallelize_model: the CP ranks were called with different inputs: {calls}; "
                         f"every rank must run the same forwards (same number, same grad mode) on the same "
                         f"batch and an equal block of the sequence (shard_sequence splits it)")


def global_masks(mesh: Any, attention_mask: Optional[torch.Tensor], positions: Optional[torch.Tensor],
                 packs: bool, cached: Callable[[], bool]) -> Optional[Dict[str, torch.Tensor]]:
    """The forward's ``attention_masks`` keywords: the gathered padding mask, else the documents of
    packed global ``positions`` where the model's own mask separates them (``packs``). Transformers
    does so only without a KV cache: packed positions on a call that would build one (``cached()``) are
    a ValueError rather than either answer in silence."""
    if attention_mask is not None:
        # on the CPU: the masked kernels decide per tile (skip / full / masked) without a device sync
        keep = gather(mesh, attention_mask.to(torch.bool)).cpu()
        return None if get_platform().is_fake(keep) or bool(keep.all()) else {"padding_mask": keep}
    if positions is None or not packs or get_platform().is_fake(positions):
        return None   # no position_ids, a model that does not separate packed documents, or a dry run
    start = torch.diff(positions, prepend=positions[:, :1] - 1, dim=-1) != 1
    if not bool(start[:, 1:].any()):
        return None
    if cached():
        raise ValueError("parallelize_model: packed position_ids (documents) with use_cache on: "
                         "transformers separates packed documents only without a KV cache, so the same "
                         "model in one process would let them attend to each other; pass use_cache=False "
                         "(training) to separate them")
    return {"document_ids": start.cumsum(-1)}


def check_documents_from_zero(positions: Optional[torch.Tensor], documents: torch.Tensor) -> None:
    """Chunked attention over packed documents counts chunks from each document's first token, which is
    what transformers does (it chunks positions) when every document's positions start at 0."""
    if positions is None:
        return
    first = torch.cat([torch.ones_like(documents[:, :1], dtype=torch.bool),
                       documents[:, 1:] != documents[:, :-1]], 1)
    if bool((positions.expand_as(documents)[first] != 0).any()):
        raise ValueError("parallelize_model: packed position_ids whose documents do not start at position 0, "
                         "with chunked attention (Llama 4): chunks of positions are not chunks of the "
                         "document's tokens; start every packed document's position_ids at 0")


def gather(mesh: Any, tensor: torch.Tensor) -> torch.Tensor:
    """The blocks of every CP rank along the sequence (dim 1)."""
    return get_platform().all_gather(tensor.contiguous(), mesh.get_group(), dim=1)


def check_attention_kept(model: torch.nn.Module, name: str) -> None:
    """ValueError when the model's attention implementation was switched away from the CP attention
    after wrapping (``set_attn_implementation("sdpa")``): each rank would attend to its block alone."""
    current = getattr(model.config, "_attn_implementation", name)
    if current != name:
        raise ValueError(f"parallelize_model: {type(model).__name__}'s attention implementation is now "
                         f"{current!r}, set after parallelize_model; under context parallelism it must stay "
                         f"{name!r} (each rank would otherwise attend to its own block alone). Switch it "
                         f"back with model.set_attn_implementation({name!r})")


def check_sequence_output(model: torch.nn.Module, output: Any, local: int) -> None:
    """ValueError when the model's logits have no sequence dim of this rank's block length (a pooling
    head such as *ForSequenceClassification would pool each rank's own block)."""
    logits = getattr(output, "logits", None)
    if torch.is_tensor(logits) and (logits.ndim < 3 or int(logits.shape[1]) != local):
        raise ValueError(f"parallelize_model: {type(model).__name__} returns logits of shape "
                         f"{tuple(logits.shape)}, without this rank's {local} tokens as dim 1: a pooling "
                         f"head would pool each rank's own block under context parallelism. Use the "
                         f"*ForCausalLM model (per-token logits) with context parallelism")


def would_use_cache(model: Any, kwargs: Dict[str, Any]) -> bool:
    """Whether transformers would build a KV cache for this call (then it does not separate packed
    documents): ``use_cache`` as passed, else the config's, off under gradient checkpointing in training."""
    use = kwargs.get("use_cache")
    if use is None:
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        use = getattr(config, "use_cache", False)
    # transformers 5.x renamed is_gradient_checkpointing (deprecated, warns) to is_activation_checkpointing
    checkpointing = getattr(model, "is_activation_checkpointing", None)
    if checkpointing is None:
        checkpointing = getattr(model, "is_gradient_checkpointing", False)
    if use and model.training and torch.is_grad_enabled() and checkpointing:
        return False
    return bool(use)


def check_sources_kept(model: Any, hooks: List[Any], calls_before: List[int]) -> None:
    """ValueError when a position source found at setup did not run in this forward because it is no
    longer in the model (a rotary embedding replaced after parallelize_model would see local positions)."""
    kept = None
    for hook, before in zip(hooks, calls_before):
        if hook.calls == before:
            kept = {id(m) for m in model.modules()} if kept is None else kept
            if id(hook.module()) not in kept:
                raise ValueError(f"parallelize_model: {hook.name} ({hook.cls}), where {type(model).__name__} "
                                 f"reads positions, was replaced after parallelize_model: the new module "
                                 f"would see each rank's own positions; replace it before parallelize_model")
