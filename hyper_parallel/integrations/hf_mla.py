"""Hugging Face MLA layers (DeepSeek-V3, V3.2) under all-gather KV: the latent travels (SPEC §12).

Under ``ulysses_degree=1`` with ``kv_exchange="allgather"`` (load balance or not), the forward of each
MLA attention module is replaced (the platform's ``replace_forward``) by the same computation with
one change of order: q stays this rank's block, the compressed latent ``k_pass`` (after
kv_a_layernorm) and the roped shared key ``k_rot`` are gathered in one collective
(core/context_parallel/mla), and ``expand_kv`` (kv_b_proj) runs after the gather on the whole
sequence. Then local q attends the global K/V through the all-gather-KV kernel rule (global causal
offset, padding / packed documents, head-tail load balance). Bytes per rank fall from
S·H·(d_qk + d_v) to S·(kv_lora_rank + rope_dim) (× (P−1)/P), ≈ 71× for DeepSeek-V3's shapes.

DeepSeek Sparse Attention (V3.2): the indexer runs as transformers wrote it, handed a ``cache``
whose ``update_indexer`` returns the gathered indexer key, and the mask of the keys each local
query may see by global position; its top-k is then taken over the global keys and the attention
attends visible ∧ selected keys, as on one device. Top-k over the global keys is what makes it
exact, so V3.2 under any other mode (Ulysses, ring, hybrid, auto) is a ValueError naming the mode,
raised on every rank before any collective. Other modes keep V3's per-head path (exact there).

Classes are recognised by their code, not their names: a module whose ``forward`` and
``expand_kv`` read exactly as transformers' DeepseekV3Attention's (Glm4MoeLite and Youtu are such
copies) takes the MLA path; as DeepseekV32Attention's with its indexer's, the DSA path. Anything
else (DeepSeek-V2's complex rope, Kimi's NoPE MLA, GLM's DSA variants) keeps the per-head path or
stays refused by the sequence audit, which still measures the whole model: while it probes, these
modules run a token-local stand-in (hf_sequence_audit.py), as attention does.
"""
from typing import Any, Optional
import functools
import inspect
import sys
import weakref

import torch
import torch.nn.functional as F

from hyper_parallel.core.context_parallel import attention as hp_attention
from hyper_parallel.core.context_parallel.masks.attention_masks import attention_masks
from hyper_parallel.core.context_parallel.mla import (attend_gathered, gather_latents,
                                                      gather_sequence_no_grad, selected_keys,
                                                      sparse_attention, visible_keys)
from hyper_parallel.integrations.hf_attention_args import attention_variant, check_attention_kwargs
from hyper_parallel.integrations.hf_mask_probe import CAUSAL, MaskSpec, classify, grid_size
from hyper_parallel.integrations.hf_sequence_audit import is_probing, mark_sequence_exact
from hyper_parallel.platform import get_platform


def _source(fn):
    try:
        return inspect.getsource(fn)
    except (OSError, TypeError):
        return None


@functools.lru_cache(maxsize=1)
def _references():
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as v3
    from transformers.models.deepseek_v32 import modeling_deepseek_v32 as v32
    mla = (_source(v3.DeepseekV3Attention.forward), _source(v3.DeepseekV3Attention.expand_kv))
    dsa = (_source(v32.DeepseekV32Attention.forward), _source(v32.DeepseekV32Attention.expand_kv),
           _source(v32.DeepseekV32Indexer.forward))
    return mla, dsa


def mla_kind(module: Any) -> Optional[str]:
    """"mla" (DeepSeek-V3's code), "dsa" (DeepSeek-V3.2's, with its indexer) or None."""
    cls = type(module)
    if not hasattr(cls, "expand_kv") or not hasattr(module, "kv_a_proj_with_mqa"):
        return None
    mla, dsa = _references()
    code = (_source(cls.forward), _source(cls.expand_kv))
    if code == mla and None not in mla:
        return "mla"
    indexer = getattr(module, "indexer", None)
    if indexer is not None and code + (_source(type(indexer).forward),) == dsa and None not in dsa:
        return "dsa"
    return None


def cp_mode_name(cp_mesh: Any, cp_kwargs: Any) -> Any:
    """The attention mode the ContextParallel keywords choose: allgather, ulysses, hybrid, ring or auto."""
    if cp_kwargs.get("mode") == "auto":
        return "auto"
    if cp_kwargs.get("kv_exchange", "allgather") == "ring":
        return "ring"
    ds = cp_kwargs.get("ulysses_degree") or cp_mesh.size()
    if ds == 1:
        return "allgather"
    return "ulysses" if ds == cp_mesh.size() else "hybrid"


class _LatentPath:
    """What the replaced forwards share: the CP mesh, load balance, and the model (for its masks)."""

    def __init__(self, model, mesh, load_balance):
        self.model, self.mesh, self.load_balance = weakref.ref(model), mesh, bool(load_balance)

    def masks(self, position_ids):
        """The padding / document masks of the forward this call belongs to (kwargs for attention_masks)."""
        state = getattr(self.model(), "_hp_cp_attention", None)
        masks = None if state is None else state.masks_for({"position_ids": position_ids})
        return masks or {}


_RESTRICTIONS: Any = weakref.WeakKeyDictionary()   # MLA module -> the restriction its mask was found to make


def _check_call(module, attention_mask, cache, kwargs):
    if cache is not None or kwargs.get("past_key_values") is not None:
        raise ValueError(f"parallelize_model: {type(module).__name__} was called with a cache; context "
                         f"parallelism splits the sequence for training, pass use_cache=False")
    if isinstance(attention_mask, MaskSpec):   # the model's own mask, handed back unbuilt (hf_mask_probe.py)
        restriction = _RESTRICTIONS.get(module)
        if restriction is None:   # met first in the setup audit (no padding / packing folded in)
            restriction, why = classify(attention_mask, grid_size(module.config))
            _RESTRICTIONS[module] = restriction
            if restriction is None:
                raise ValueError(f"parallelize_model: the attention mask of {type(module).__name__} "
                                 f"restricts attention in a way context parallelism does not reproduce: "
                                 f"{why}")
        if restriction != CAUSAL:
            raise ValueError(f"parallelize_model: {type(module).__name__}'s mask is a "
                             f"{restriction.describe()} mask, which its latent path does not implement; "
                             f"train it without a 'cp' dim")
    elif attention_mask is not None:
        raise ValueError(f"parallelize_model: {type(module).__name__} received a prepared mask tensor; "
                         f"under context parallelism pass the 2-D padding attention_mask (this rank's "
                         f"block) instead")


def _rope(module, kind):
    """The rope the class's own forward applies (looked up in its own modeling module)."""
    code = sys.modules[type(module).__module__]
    if kind == "dsa" or module.config.rope_interleave:
        return code.apply_rotary_pos_emb_interleave
    return code.apply_rotary_pos_emb


def _project(module, hidden, position_embeddings, rope):
    """(query (B, H, L, d_qk), latent k_pass (B, 1, L, r), roped k_rot (B, 1, L, d_rope), q_resid)."""
    batch, length = hidden.shape[:-1]
    q_resid = None
    if module.q_lora_rank is None:
        q_states = module.q_proj(hidden)
    else:
        q_resid = module.q_a_layernorm(module.q_a_proj(hidden))
        q_states = module.q_b_proj(q_resid)
    q_states = q_states.view(batch, length, -1, module.qk_head_dim).transpose(1, 2)
    q_pass, q_rot = torch.split(q_states, [module.qk_nope_head_dim, module.qk_rope_head_dim], dim=-1)
    kv_pass, k_rot = torch.split(module.kv_a_proj_with_mqa(hidden),
                                 [module.kv_lora_rank, module.qk_rope_head_dim], dim=-1)
    k_pass = module.kv_a_layernorm(kv_pass).view(batch, 1, length, module.kv_lora_rank)
    k_rot = k_rot.view(batch, 1, length, module.qk_rope_head_dim)
    cos, sin = position_embeddings
    q_rot, k_rot = rope(q_rot, k_rot, cos, sin)
    return torch.cat((q_pass, q_rot), dim=-1), k_pass, k_rot, q_resid


def _dropout(module):
    return module.attention_dropout if module.training else 0.0


def _attend_mla(module, path, query, key, value, kwargs):
    """Local q against the gathered K/V by the all-gather-KV kernel rule; (B, L, H, d_v)."""
    check_attention_kwargs(module, kwargs)
    causal = kwargs.get("is_causal")
    causal = getattr(module, "is_causal", True) if causal is None else causal
    softcap, sinks, window = attention_variant(module, kwargs, key.shape[2])
    variant = softcap is not None or sinks is not None or window is not None
    masks, dropout = path.masks(kwargs.get("position_ids")), _dropout(module)
    if (masks or variant) and dropout:
        raise ValueError(f"parallelize_model: attention dropout {dropout} with a padding mask, packed "
                         f"position_ids, soft-capping, sinks or a window under context parallelism is not "
                         f"supported; set the config's attention_dropout=0 or call model.eval()")

    def call(q, k, v):
        if variant:
            out = hp_attention(q, k, v, is_causal=causal, scale=module.scaling, softcap=softcap, sinks=sinks,
                               window=window)
        else:
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=causal,
                                                 scale=module.scaling)
        return out.transpose(1, 2)
    with attention_masks(**masks) as active:
        return attend_gathered(query, key, value, path.mesh, call, path.load_balance, active)


class _GatheringIndexerCache:
    """Handed to transformers' DSA indexer as its ``cache``: the indexer asks it for the keys to
    score (``update_indexer``), and gets the whole sequence's indexer key, gathered (no gradient)."""

    def __init__(self, mesh):
        self.mesh = mesh

    def update_indexer(self, key, layer_idx):
        return gather_sequence_no_grad(key, self.mesh, 1)


def _attend_dsa(module, path, query, key, value, index_inputs, kwargs):
    """Local q against the gathered K/V on the keys visible by global position and chosen by the
    indexer's top-k over the global keys; (B, L, H, d_v)."""
    hidden, q_resid, position_embeddings, position_ids = index_inputs
    check_attention_kwargs(module, kwargs)
    if any(x is not None for x in attention_variant(module, kwargs, key.shape[2])) or _dropout(module):
        raise ValueError(f"parallelize_model: {type(module).__name__} (DeepSeek Sparse Attention) with "
                         f"attention dropout, soft-capping, sinks or a window under context parallelism is "
                         f"not implemented")
    batch, _, rows, _ = query.shape
    total = key.shape[2]
    with attention_masks(**path.masks(position_ids)) as masks:
        start = path.mesh.get_local_rank() * rows   # this rank's contiguous block of query rows
        allowed = visible_keys(batch, start, rows, total, masks, device=query.device)
    indices = module.indexer(hidden, q_resid, position_embeddings, allowed, position_ids,
                             cache=_GatheringIndexerCache(path.mesh))
    out = sparse_attention(query, key, value, allowed, selected_keys(indices, total), module.scaling)
    return out.transpose(1, 2)


def _latent_forward(module, path, kind):
    rope = _rope(module, kind)

    def forward(hidden_states, position_embeddings, attention_mask=None, cache=None, position_ids=None,
                **kwargs):
        _check_call(module, attention_mask, cache, kwargs)
        query, k_pass, k_rot, q_resid = _project(module, hidden_states, position_embeddings, rope)
        if is_probing(module):   # the audit's token-local stand-in: each token its own value
            _, value = module.expand_kv(k_pass, k_rot)
            out = value.transpose(1, 2)
        else:
            k_pass, k_rot = gather_latents([k_pass, k_rot], path.mesh, 2)
            key, value = module.expand_kv(k_pass, k_rot)   # the up-projection, on the whole sequence
            if kind == "dsa":
                index_inputs = (hidden_states, q_resid, position_embeddings, position_ids)
                out = _attend_dsa(module, path, query, key, value, index_inputs, kwargs)
            else:
                out = _attend_mla(module, path, query, key, value, dict(kwargs, position_ids=position_ids))
        batch, length = hidden_states.shape[:-1]
        return module.o_proj(out.reshape(batch, length, -1).contiguous()), None
    return forward


def _refuse_dsa(model, found, mode, tensor_parallel):
    dsa = [name for name, _, kind in found if kind == "dsa"]
    if dsa and mode != "allgather":
        raise ValueError(f"parallelize_model: {type(model).__name__} uses DeepSeek Sparse Attention "
                         f"({dsa[0]}), whose top-k must be taken over the global keys, which context "
                         f"parallelism does only in the all-gather mode; the {mode!r} mode was requested. "
                         f"Use the all-gather mode: ulysses_degree=1 (kv_exchange='allgather', load_balance "
                         f"optional)")
    if dsa and tensor_parallel:
        raise ValueError(f"parallelize_model: {type(model).__name__} uses DeepSeek Sparse Attention "
                         f"({dsa[0]}), which context parallelism does not run together with tensor "
                         f"parallelism yet; use a mesh without the 'tp' dim")


def make_mla_exact(model: Any, cp_mesh: Any, cp_kwargs: Any, tensor_parallel: bool = False) -> Any:
    """Under all-gather KV, give every MLA module the latent path; returns their names. V3.2 (DSA)
    in another mode, or with tensor parallelism, is a ValueError (checked on every rank before any
    module is replaced or any collective runs). With TP, MLA keeps the per-head path."""
    found = [(name, module, kind) for name, module in model.named_modules()
             if (kind := mla_kind(module)) is not None]
    if not found:
        return []
    mode = cp_mode_name(cp_mesh, cp_kwargs)
    _refuse_dsa(model, found, mode, tensor_parallel)
    if mode != "allgather" or tensor_parallel:
        return []
    path = _LatentPath(model, cp_mesh, cp_kwargs.get("load_balance", False))
    platform = get_platform()
    for _, module, kind in found:
        platform.replace_forward(module, lambda _original, m=module, k=kind: _latent_forward(m, path, k))
        mark_sequence_exact(module)
    return [name for name, _, _ in found]
