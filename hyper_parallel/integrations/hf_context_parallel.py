"""Context-parallel attention for Hugging Face models through transformers' ``AttentionInterface``.

Each CP rank runs the whole model on its contiguous sequence block (``shard_sequence``). The
model's attention modules call the registered attention function with BNSD q/k/v blocks; it runs
a ``ContextParallel(seq_dim=2, head_dim=1)`` core-attention module, which returns this rank's BSHD
block, as HF's attention functions do.

Masks. With a custom attention name transformers builds no mask (its mask factory only knows its
own names), and a mask built from a rank's block would be wrong anyway: keys live on every rank.
So a forward pre-hook on the base model, once per forward, all-gathers the blocks of the 2-D
padding ``attention_mask`` and of ``position_ids`` over the CP ranks and builds the global mask
exactly as transformers' sdpa path does on one device:

- ``attention_mask`` given: causal and the key is not padding;
- else ``position_ids`` holding several documents (packed: a position that does not follow its
  predecessor starts a document): causal on positions, within a document;
- else none: ``is_causal``.

The mask is dense, ``(batch, 1, S, S)`` booleans per rank (all-gather KV slices it to the rank's
rows). Missing ``position_ids`` are filled with the block's global positions (transformers would
count from 0 on every rank). Unsupported inputs raise ``ValueError``: 4-D masks, KV caches, a
sliding window shorter than the sequence, and masks with ``kv_exchange="ring"``.
"""
import copy
import itertools

import torch
import torch.nn.functional as F

from hyper_parallel.core.context_parallel import ContextParallel
from hyper_parallel.platform import get_platform

_names = itertools.count()


class _CoreAttention(torch.nn.Module):
    """BNSD q/k/v in, BSHD out (the layout HF attention functions return)."""

    def forward(self, q, k, v, mask=None, scale=None, dropout=0.0, causal=True, gqa=False):
        extra = {"enable_gqa": True} if gqa else {}
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout,
                                             is_causal=causal and mask is None, scale=scale, **extra)
        return out.transpose(1, 2)


class CPAttention:
    """The per-model state: the CP core attention, and the global mask of the current forward."""

    def __init__(self, model, cp_mesh, cp_kwargs):
        self.config = model.config
        self.mesh = cp_mesh
        self.ring = cp_kwargs.get("kv_exchange") == "ring"
        self.core = ContextParallel(seq_dim=2, head_dim=1, **cp_kwargs).apply(_CoreAttention(), cp_mesh)
        self.mask = None
        self.name = f"hyper_parallel_cp_{next(_names)}"

    # ------------------------------------------------------------------ the attention function
    def __call__(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        if attention_mask is not None:
            raise ValueError("parallelize_model: the attention received a prepared mask tensor; under "
                             "context parallelism pass the 2-D padding attention_mask (this rank's block) "
                             "instead")
        causal = kwargs.get("is_causal")
        causal = getattr(module, "is_causal", True) if causal is None else causal
        gqa = query.shape[1] != key.shape[1]
        out = self.core(query, key, value, self.mask, scaling, dropout, causal, gqa)
        return out, None

    # ------------------------------------------------------------------ once per forward
    def pre_forward(self, module, args, kwargs):
        if len(args) > 1:
            raise ValueError("parallelize_model: under context parallelism call the model with keyword "
                             "arguments (input_ids=..., attention_mask=..., position_ids=...)")
        for name in ("past_key_values", "cache"):
            if kwargs.get(name) is not None:
                raise ValueError("parallelize_model: KV caches are not supported under context parallelism "
                                 "(each rank holds a block of the sequence); use the model for training")
        kwargs["use_cache"] = False
        first = args[0] if args else kwargs.get("input_ids")
        if first is None:
            first = kwargs.get("inputs_embeds")
        batch, local = int(first.shape[0]), int(first.shape[1])
        positions = self._positions(kwargs.get("position_ids"), batch, local)
        kwargs["position_ids"] = positions
        self.mask = self._global_mask(kwargs.get("attention_mask"), positions, batch, local)
        return args, kwargs

    def post_forward(self, module, args, kwargs, output):
        self.mask = None  # autograd keeps what backward needs
        return output

    def _gather(self, tensor):
        return get_platform().all_gather(tensor.contiguous(), self.mesh.get_group(), dim=1)

    def _positions(self, positions, batch, local):
        if positions is None:
            start = self.mesh.get_local_rank() * local
            return torch.arange(start, start + local).unsqueeze(0)
        if positions.ndim != 2 or positions.shape[-1] != local:
            raise ValueError(f"parallelize_model: position_ids of shape {tuple(positions.shape)} must be "
                             f"this rank's block (batch, {local}) of the global positions (shard_sequence)")
        return positions

    def _global_mask(self, attention_mask, positions, batch, local):
        total = local * self.mesh.size()
        self._check_window(total)
        if attention_mask is not None:
            if attention_mask.ndim != 2 or tuple(attention_mask.shape) != (batch, local):
                raise ValueError(f"parallelize_model: attention_mask of shape {tuple(attention_mask.shape)} "
                                 f"is not supported under context parallelism; pass the 2-D padding mask's "
                                 f"block "
                                 f"({batch}, {local}) from shard_sequence")
            keep = self._gather(attention_mask.to(torch.bool))
            if bool(keep.all()):
                return None
            causal = torch.ones(total, total, dtype=torch.bool, device=keep.device).tril()
            return self._no_ring(causal[None, None] & keep[:, None, None, :])
        pos = self._gather(positions.expand(batch, -1))
        start = torch.diff(pos, prepend=pos[:, :1] - 1, dim=-1) != 1
        if not bool(start[:, 1:].any()):
            return None
        doc = start.cumsum(-1)
        mask = (pos[:, :, None] >= pos[:, None, :]) & (doc[:, :, None] == doc[:, None, :])
        return self._no_ring(mask[:, None])

    def _no_ring(self, mask):
        if self.ring:
            raise ValueError("parallelize_model: kv_exchange='ring' takes no attention mask; padding masks "
                             "and packed position_ids need kv_exchange='allgather' (or Ulysses)")
        return mask

    def _check_window(self, total):
        config = self.config.get_text_config() if hasattr(self.config, "get_text_config") else self.config
        window = getattr(config, "sliding_window", None)
        used = getattr(config, "use_sliding_window", True)
        layer_types = getattr(config, "layer_types", None) or ()
        if window and used and (not layer_types or "sliding_attention" in layer_types) and total > window:
            raise ValueError(f"parallelize_model: sliding-window attention (window {window} < sequence "
                             f"{total}) is not supported under context parallelism")


def _own_config(model):
    """Give the model a config of its own before switching its attention implementation: a config
    object shared with another model (built from the same config) would switch that one too."""
    old = model.config
    new = copy.deepcopy(old)
    for module in model.modules():
        if module.__dict__.get("config") is old:
            module.config = new


def apply_context_parallel(model, cp_mesh, cp_kwargs):
    from transformers import AttentionInterface

    _own_config(model)
    state = CPAttention(model, cp_mesh, cp_kwargs)
    AttentionInterface.register(state.name, state)
    model.set_attn_implementation(state.name)
    if model.config._attn_implementation != state.name:
        raise ValueError(f"parallelize_model: {type(model).__name__} does not accept a custom attention "
                         f"implementation (transformers' AttentionInterface), so context parallelism cannot "
                         f"be applied")
    base = model.base_model
    base.register_forward_pre_hook(state.pre_forward, with_kwargs=True)
    base.register_forward_hook(state.post_forward, with_kwargs=True)
    model._hp_cp_attention = state
    return model
