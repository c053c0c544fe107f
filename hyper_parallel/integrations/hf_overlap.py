"""Llama-family attention blocks whose q/k/v projections overlap their context-parallel collectives
(``parallelize_model(model, mesh, overlap=True, chunks=n)``).

ContextParallel sits at the attention call, after the projections and RoPE, so on its own it can
only overlap what follows that call (its head-chunk pipeline, core/context_parallel/overlap/pipeline.py).
Heads are independent up to the output projection, so here the block itself runs in n head
groups: group c's rows of q_proj / k_proj / v_proj, its per-head norms (Qwen3) and RoPE, then
``start_attention`` launches group c's fused q/k/v collective and returns; group c+1's
projections compute while it travels; then group c finishes (attention, output all-to-all) while
group c+1's collective travels. The groups' outputs join on the heads before o_proj.

Backward mirrors it: group c's collective nodes are created between group c's and group c+1's
projections, and the autograd engine runs ready nodes newest first, so group c+1's projection
backward (its weight and input gradients) runs while group c's gradient collective travels.

Only blocks of the classes in ``_KNOWN`` are pipelined, and only with plain ``nn.Linear``
projections (no hooks, not TP-sharded), per-head q/k norms if any, and head counts the groups
divide (q heads per group divisible by the Ulysses degree, k/v heads by the groups). A call with an
attention mask, a KV cache, attention dropout, padding masks / packed documents
(``attention_masks``), or a DTensor input runs the block's own forward (where the style's
head-chunk overlap still applies). Values equal the block's own forward (tests/test_hf_overlap.py).
"""
from typing import Any
import sys

import torch
import torch.nn.functional as F

from hyper_parallel.core.context_parallel.overlap.pipeline import pipeline_observer
from hyper_parallel.core.dtensor.dtensor import DTensor
from hyper_parallel.platform import get_platform

_KNOWN = ("LlamaAttention", "Qwen2Attention", "Qwen3Attention", "MistralAttention")
_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")


def _plain_linear(module):
    return (type(module) is torch.nn.Linear and not isinstance(module.weight, DTensor)
            and not module._forward_hooks and not module._forward_pre_hooks)


def _per_head_norm(module, name, head_dim):
    norm = getattr(module, name, None)
    weight = getattr(norm, "weight", None)
    return norm is None or (weight is not None and tuple(weight.shape) == (head_dim,))


def pipeline_groups(module: Any, ulysses_degree: Any, groups: Any) -> Any:
    """How many head groups ``module``'s forward can run in (1: leave it alone)."""
    cls = type(module)
    if cls.__name__ not in _KNOWN or not cls.__module__.startswith("transformers.models."):
        return 1
    head_dim = getattr(module, "head_dim", None)
    rope = getattr(sys.modules.get(cls.__module__), "apply_rotary_pos_emb", None)
    if not head_dim or rope is None or not all(_plain_linear(getattr(module, n, None)) for n in _PROJECTIONS):
        return 1
    if not all(_per_head_norm(module, n, head_dim) for n in ("q_norm", "k_norm")):
        return 1
    q_heads, kv_heads = module.q_proj.out_features // head_dim, module.k_proj.out_features // head_dim
    if q_heads % groups or kv_heads % groups or (q_heads // groups) % ulysses_degree:
        return 1
    return groups


class PipelinedAttention:
    """The replacement forward of one attention block (see the module docstring)."""

    def __init__(self, module: Any, original: Any, state: Any, groups: Any) -> None:
        self.module, self.original, self.state, self.groups = module, original, state, groups
        self.rope = sys.modules[type(module).__module__].apply_rotary_pos_emb

    def __call__(self, *args, **kwargs):
        names = ("hidden_states", "position_embeddings", "attention_mask", "cache")
        bound = dict(zip(names, args))
        bound.update((n, kwargs.get(n)) for n in names if n not in bound)
        cache = bound["cache"] if bound["cache"] is not None else kwargs.get("past_key_values")
        module = self.module
        dropout = module.attention_dropout if module.training else 0.0
        # the model's mask restricts nothing beyond causality here (a window as long as the sequence is none)
        restriction = self.state.restriction(module, bound["attention_mask"])
        total = bound["hidden_states"].shape[1] * self.state.mesh.size()
        plain = restriction.causal and restriction.chunk is None and (restriction.window or total) >= total
        if (len(args) > len(names) or not plain or cache is not None or dropout
                or self.state.masks_for(kwargs) is not None or bound["position_embeddings"] is None
                or isinstance(bound["hidden_states"], DTensor)
                or not all(_plain_linear(getattr(module, n)) for n in _PROJECTIONS)):
            return self.original(*args, **kwargs)
        # what the block's own forward hands the attention function besides q/k/v (is_causal, ...)
        extra = {n: v for n, v in kwargs.items() if n not in names and n != "past_key_values"}
        return self._pipelined(bound["hidden_states"], *bound["position_embeddings"], extra)

    def _pipelined(self, hidden, cos, sin, extra):
        module, n = self.module, self.groups
        outs, pending = [], None
        for c in range(n):
            q, k, v = self._group_qkv(hidden, c, cos, sin)
            started = self.state.start(module, q, k, v, module.scaling, 0.0, **extra)
            if pending is not None:   # the previous group's attention, while this group's q/k/v travel
                outs.append(pending.finish())
            pending = started
        outs.append(pending.finish())
        out = torch.cat(outs, dim=2)   # (B, S, heads of a group, D) blocks, in head order
        return module.o_proj(out.reshape(*hidden.shape[:-1], -1).contiguous()), None

    def _group_qkv(self, hidden, c, cos, sin):
        """Group c's q, k, v (B, heads, S, D) as the block's own forward computes those heads."""
        module, n, head_dim = self.module, self.groups, self.module.head_dim
        shape = hidden.shape[:-1]

        def rows(linear):
            width = linear.out_features // n
            bias = None if linear.bias is None else linear.bias.narrow(0, c * width, width)
            out = F.linear(hidden, linear.weight.narrow(0, c * width, width), bias)
            return out.view(*shape, -1, head_dim)
        q, k, v = rows(module.q_proj), rows(module.k_proj), rows(module.v_proj)
        notify = pipeline_observer("proj", c)
        if notify is not None:
            notify("forward")
            if q.requires_grad:
                q.register_hook(_observing(notify))
        if getattr(module, "q_norm", None) is not None:
            q, k = module.q_norm(q), module.k_norm(k)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        q, k = self.rope(q, k, cos, sin)
        return q, k, v


def _observing(notify):
    def hook(grad):   # observes; returns None, so the gradient is unchanged
        notify("backward")
    return hook


def pipeline_attention_blocks(model: Any, state: Any, cp_kwargs: Any, cp_size: Any) -> Any:
    """Give every known attention block of ``model`` the pipelined forward; returns how many."""
    if cp_kwargs.get("load_balance") or cp_kwargs.get("kv_exchange", "allgather") == "ring":
        return 0
    ulysses = cp_kwargs.get("ulysses_degree") or cp_size
    done = 0
    for module in model.modules():
        groups = pipeline_groups(module, ulysses, cp_kwargs.get("chunks", 2))
        if groups > 1:
            get_platform().replace_forward(
                module, lambda original, m=module, g=groups: PipelinedAttention(m, original, state, g))
            done += 1
    return done
