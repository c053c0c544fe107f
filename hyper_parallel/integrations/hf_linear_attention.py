"""Hugging Face linear-attention layers made sequence-exact under context parallelism (SPEC §13).

Gated DeltaNet (Qwen3-Next, Qwen3.5) and Kimi Delta Attention (Kimi-Linear) mix the sequence twice:
a short causal convolution over q/k/v and the gated delta rule. Each such module's forward is
replaced (the platform's ``replace_forward``) by the same computation on this rank's block, with
the convolution's halo from the previous rank and the rule's exact incoming state
(core/context_parallel/linear_attention). Everything else in the forward is token-local and runs
as transformers writes it: the projections, the gates, the gated norm, the output projection.

The sequence audit (hf_sequence_audit.py) still measures the whole model: while it probes, these
modules run a token-local stand-in (the convolution's current-token tap, the rule's value), as
attention does, so any other module that mixes the sequence is still found and refused.

Load balance: ``load_balance=True`` reorders tokens inside the full-attention call only (the
head-tail exchange and its inverse); every other layer, these included, sees the rank's contiguous
block, so the combination is exact as it is.

Only the classes below are replaced (their forwards were read against transformers 5.x), and classes
whose code is theirs under another name prefix (Qwen3.5-MoE's Gated DeltaNet is Qwen3.5's); any
other linear-attention class stays refused by the audit.
"""
from typing import Any
import functools
import importlib

import torch
import torch.nn.functional as F

from hyper_parallel.core.context_parallel.linear_attention import (context_parallel_causal_conv1d,
                                                                   context_parallel_delta_rule)
from hyper_parallel.core.context_parallel.linear_attention.checks import MODES
from hyper_parallel.integrations.hf_sequence_audit import is_probing, mark_sequence_exact
from hyper_parallel.platform import get_platform

CHUNK = 64   # the reference rule's chunk; the result does not depend on it beyond rounding


def _gdn_gates(module, b, a):
    return b.sigmoid(), -module.A_log.float().exp() * F.softplus(a.float() + module.dt_bias)


def _qwen3_next_project(module, hidden):
    query, key, value, z, b, a = module.fix_query_key_value_ordering(module.in_proj_qkvz(hidden),
                                                                     module.in_proj_ba(hidden))
    mixed = torch.cat([x.reshape(x.shape[0], x.shape[1], -1) for x in (query, key, value)], dim=-1)
    return mixed.transpose(1, 2), z, _gdn_gates(module, b, a)


def _qwen3_5_project(module, hidden):
    batch, length, _ = hidden.shape
    z = module.in_proj_z(hidden).reshape(batch, length, -1, module.head_v_dim)
    gates = _gdn_gates(module, module.in_proj_b(hidden), module.in_proj_a(hidden))
    return module.in_proj_qkv(hidden).transpose(1, 2), z, gates


def _gdn_split(module, mixed):
    batch, length, _ = mixed.shape
    query, key, value = torch.split(mixed, [module.key_dim, module.key_dim, module.value_dim], dim=-1)
    return (query.reshape(batch, length, -1, module.head_k_dim),
            key.reshape(batch, length, -1, module.head_k_dim),
            value.reshape(batch, length, -1, module.head_v_dim))


def _gdn_finish(module, core, z):
    batch, length = core.shape[:2]
    out = module.norm(core.reshape(-1, module.head_v_dim), z.reshape(-1, module.head_v_dim))
    return module.out_proj(out.reshape(batch, length, -1))


def _kimi_project(module, hidden):
    mixed = torch.cat([module.q_proj(hidden), module.k_proj(hidden), module.v_proj(hidden)], dim=-1)
    beta = torch.sigmoid(module.b_proj(hidden))
    return mixed.transpose(1, 2), hidden, (beta, module.forget_gate(hidden))


def _kimi_split(module, mixed):
    shape = mixed.shape[:2] + (-1, module.head_dim)
    return tuple(x.reshape(shape) for x in torch.split(mixed, [module.qkv_dim] * 3, dim=-1))


def _kimi_finish(module, core, hidden):
    batch, length = core.shape[:2]
    gate = module.g_b_proj(module.g_a_proj(hidden)).view(batch, length, -1, module.head_dim)
    return module.o_proj(module.o_norm(core, gate).reshape(batch, length, -1))


# class name -> (inputs of the convolution / rule and what finish needs, the conv output's q/k/v, finish)
ADAPTERS = {
    "Qwen3NextGatedDeltaNet": (_qwen3_next_project, _gdn_split, _gdn_finish),
    "Qwen3_5GatedDeltaNet": (_qwen3_5_project, _gdn_split, _gdn_finish),
    "KimiLinearDeltaAttention": (_kimi_project, _kimi_split, _kimi_finish),
}


# the prefix of each known class's name (a copy under another prefix is the same layer)
_PREFIXES = {"Qwen3NextGatedDeltaNet": "Qwen3Next", "Qwen3_5GatedDeltaNet": "Qwen3_5",
             "KimiLinearDeltaAttention": "KimiLinear"}


def _class_source(cls):
    import inspect
    try:
        return inspect.getsource(cls)
    except (OSError, TypeError):
        return None


@functools.lru_cache(maxsize=None)
def _adapter(cls: Any) -> Any:
    """The ADAPTERS key for ``cls``: its own name, or a known class whose code it repeats under another
    name prefix (transformers' "Copied from": Qwen3.5-MoE's Gated DeltaNet is Qwen3.5's); else None."""
    if cls.__name__ in ADAPTERS:
        return cls.__name__
    for known, prefix in _PREFIXES.items():
        suffix = known[len(prefix):]
        if not cls.__name__.endswith(suffix) or not cls.__module__.startswith("transformers."):
            continue
        mine = _class_source(cls)
        reference = getattr(importlib.import_module(_MODULES[known]), known, None)
        theirs = _class_source(reference) if reference is not None else None
        if mine and theirs and mine.replace(cls.__name__[:-len(suffix)], prefix) == theirs:
            return known
    return None


_MODULES = {"Qwen3NextGatedDeltaNet": "transformers.models.qwen3_next.modeling_qwen3_next",
            "Qwen3_5GatedDeltaNet": "transformers.models.qwen3_5.modeling_qwen3_5",
            "KimiLinearDeltaAttention": "transformers.models.kimi_linear.modeling_kimi_linear"}


class _Mixing:
    """The two sequence-mixing steps of one layer: on the CP blocks, or token-local while audited."""

    def __init__(self, group, mode):
        self.group, self.mode = group, mode

    def conv(self, module, x, weight, bias):
        if is_probing(module):   # the current token's tap only
            out = x * weight[:, -1:]
            return out if bias is None else out + bias.unsqueeze(-1)
        return context_parallel_causal_conv1d(x, weight, bias, self.group)

    def rule(self, module, q, k, v, g, beta):
        if is_probing(module):
            return v
        return context_parallel_delta_rule(q, k, v, g, beta, self.group, mode=self.mode, chunk_size=CHUNK)


def _check_call(module, cache, kwargs):
    if cache is not None or kwargs.get("cache_params") is not None:
        raise ValueError(f"parallelize_model: {type(module).__name__} was called with a cache; context "
                         f"parallelism splits the sequence for training, pass use_cache=False")


def _cp_forward(module, adapter, mixing):
    from transformers.activations import ACT2FN
    project, split, finish = adapter
    activation = ACT2FN[module.activation]

    def forward(hidden_states, cache=None, attention_mask=None, **kwargs):
        _check_call(module, cache, kwargs)
        if attention_mask is not None:   # padding: token-local, this rank's block of the 2-D mask
            hidden_states = (hidden_states * attention_mask[:, :, None]).to(hidden_states.dtype)
        mixed, keep, (beta, g) = project(module, hidden_states)
        weight = module.conv1d.weight.squeeze(1)
        conv = mixing.conv(module, mixed.to(weight.dtype), weight, module.conv1d.bias)
        q, k, v = split(module, activation(conv).to(mixed.dtype).transpose(1, 2))
        return finish(module, mixing.rule(module, q, k, v, g, beta), keep)
    return forward


def make_linear_attention_exact(model: Any, cp_mesh: Any, mode: str = "allgather",
                                tensor_parallel: bool = False) -> Any:
    """Replace the forward of every known linear-attention module by its CP form; returns their names.
    ``mode``: how the recurrent state crosses ranks, "allgather" (default) or "p2p". Refused together
    with tensor parallelism (the layers' TP-split projections are not handled: checked on every
    rank before anything is replaced)."""
    if mode not in MODES:
        raise ValueError(f"parallelize_model(linear_attention={mode!r}): pass one of {MODES} (how the "
                         f"linear-attention state crosses the CP ranks)")
    # _adapter's lru_cache wrapper asks for Hashable arguments, which mypy does not see in a class
    found = [(name, module) for name, module in model.named_modules()
             if _adapter(type(module)) is not None]  # type: ignore[arg-type]
    if found and tensor_parallel:
        raise ValueError(f"parallelize_model: {type(model).__name__} has linear-attention layers "
                         f"({found[0][0]}: {type(found[0][1]).__name__}), which context parallelism splits "
                         f"exactly but not together with tensor parallelism yet; use a mesh without the 'tp' "
                         f"dim (context parallelism and data parallelism only)")
    platform = get_platform()
    mixing = _Mixing(cp_mesh.get_group(), mode)
    replaced = []
    for name, module in found:
        adapter = ADAPTERS[_adapter(type(module))]  # type: ignore[arg-type]
        platform.replace_forward(module, lambda _original, m=module, a=adapter: _cp_forward(m, a, mixing))
        mark_sequence_exact(module)
        replaced.append(name)
    return replaced
