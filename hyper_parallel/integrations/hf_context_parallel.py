"""Context-parallel attention for Hugging Face models through transformers' ``AttentionInterface``.

Each CP rank runs the whole model on its contiguous sequence block (``shard_sequence``). The
model's attention modules call the registered attention function with BNSD q/k/v blocks; it runs
a ``ContextParallel(seq_dim=2, head_dim=1)`` core-attention module, which returns this rank's BSHD
block, as HF's attention functions do.

Masks. With a custom attention name transformers builds no mask (its mask factory only knows its
own names), and a mask built from a rank's block would be wrong anyway: keys live on every rank.
So a forward pre-hook on the base model, once per forward, all-gathers the blocks of the 2-D
padding ``attention_mask`` and of ``position_ids`` over the CP ranks (O(B·S) integers) and turns
them into ``attention_masks`` (core/context_parallel/masks/), which every CP mode applies
(Ulysses, all-gather KV ± load balance, hybrid, ring ± zigzag) tile by tile, without an S×S mask.
They reproduce transformers' sdpa path on one device:

- ``attention_mask`` given: ``padding_mask`` (a padded key is seen by no query), with the module's
  causality;
- else ``position_ids`` holding several documents (packed: a position that does not follow its
  predecessor starts a document): ``document_ids``, with the module's causality (within a
  document, positions follow the token order, so causal on positions is causal on tokens);
- else none: ``is_causal``.

Positions: every module that reads them sees the global ones (hf_positions.py, hf_block_cache.py).
Gemma 2's ``softcap``, gpt-oss's ``s_aux`` sinks and a ``sliding_window`` shorter than the sequence go
to ``hyper_parallel.attention`` in every mode (hf_attention_args.py). Unsupported inputs raise
``ValueError``: 4-D masks, KV caches, attention keywords it does not implement, attention dropout with
a padding mask, packing, soft-capping, sinks or a window. Before any of this, the model is audited
for modules that mix the sequence outside attention (hf_sequence_audit.py), and every forward starts
with one fixed-size exchange of each rank's input shapes, so ranks that disagree all raise first.
"""
import copy
import itertools
import weakref
from typing import Any, Dict, Optional

import torch
import torch.nn.functional as F

from hyper_parallel.core.context_parallel import ContextParallel, attention as hp_attention, start_attention
from hyper_parallel.core.context_parallel.masks.attention_masks import attention_masks
from hyper_parallel.integrations import hf_cp_inputs, hf_mask_probe, hf_positions
from hyper_parallel.integrations.hf_attention_args import attention_variant, check_attention_kwargs
from hyper_parallel.integrations.hf_overlap import pipeline_attention_blocks
from hyper_parallel.integrations.hf_probe_state import kept_state
from hyper_parallel.integrations.hf_sequence_audit import refuse_sequence_mixing
from hyper_parallel.platform import get_platform

_names = itertools.count()


class _CoreAttention(torch.nn.Module):
    """BNSD q/k/v in, BNSD out (q's own layout: a sequence as long as head_dim is no ambiguous output
    dim); the caller makes the local block the BSHD HF attention functions return. No mask argument:
    padding and documents arrive through ``attention_masks``, which the CP modes apply here.
    Soft-capping, sinks and a window go through ``hyper_parallel.attention``; else plain sdpa."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: Optional[float] = None,
                dropout: float = 0.0, causal: bool = True, gqa: bool = False, softcap: Optional[float] = None,
                sinks: Optional[torch.Tensor] = None, window: Optional[int] = None) -> torch.Tensor:
        if softcap is not None or sinks is not None or window is not None:
            return hp_attention(q, k, v, is_causal=causal, scale=scale, softcap=softcap, sinks=sinks,
                                window=window)
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=causal, scale=scale,
                                              enable_gqa=gqa)


class CPAttention:
    """The per-model state: the CP core attention, and the global masks of each forward
    (``attention_masks`` keyword arguments, or None).

    Activation checkpointing runs a layer's forward again during backward, after the model's
    forward ended: its attention calls must see the masks of *their* forward, not of the latest
    one (several forwards may precede one backward). So each forward's masks are filed under the
    ``position_ids`` tensor that forward hands to every layer (a fresh view per forward, which
    checkpointing keeps as a layer input), and found again from the call's ``position_ids``."""

    def __init__(self, model, cp_mesh, cp_kwargs):
        self.config = model.config
        self.mesh = cp_mesh
        # style.last_choice under mode='auto'
        self.style = ContextParallel(seq_dim=2, head_dim=1, **cp_kwargs)
        self.core = self.style.apply(_CoreAttention(), cp_mesh)
        self.masks, self.in_forward = None, False
        self.model = weakref.ref(model)
        # the sequence-mixing audit (hf_sequence_audit.py): its runs get a token-local stand-in for
        # attention; a model still on the meta device is audited at its first forward
        self.probing, self.audit_pending, self.disabled = False, False, False
        # per attention module: what the model's own mask restricts (hf_mask_probe.py), from the audit
        self.restrictions = weakref.WeakKeyDictionary()
        self.mask_grid = hf_mask_probe.grid_size(model.config)
        # eager attention applies the model's mask as built; sdpa / flash skip a plain causal one and use
        # the module's is_causal (BigBird-Pegasus's decoder: a causal mask, is_causal False, eager only)
        impl = getattr(model.config, "_attn_implementation", None)
        self.mask_decides = impl not in ("sdpa", "flash_attention_2", "flash_attention_3", "flex_attention")
        # position sources (hf_positions.py), this forward's global positions, the entry's offset
        self.sources, self.context, self.entry_offset = [], None, 0
        self._by_positions = {}   # id(a forward's position_ids) -> (weak ref to them, its masks)
        # forwards so far (ranks compare it), whether the model's masks separate packed documents
        self.forwards, self.packs, self.seen_masks = 0, True, None
        self.source_hooks, self.source_calls = [], []   # hf_positions.SourceHook, their calls so far
        self.name = f"hyper_parallel_cp_{next(_names)}"

    # ------------------------------------------------------------------ the attention function
    def __call__(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        if self.probing:
            if self.seen_masks is not None:   # the packing probe (audit)
                self.seen_masks.append(attention_mask)
            self.learn_mask(module, attention_mask)
            check_attention_kwargs(module, kwargs)
            return _token_local_attention(query, key, value), None
        query, key, value = _autocast(query, key, value)
        carried = attention_mask.forward_masks if isinstance(attention_mask, hf_mask_probe.MaskSpec) else None
        # the masks the spec carries (a compiled layer's graph inputs), else found by position_ids
        masks = (carried or None) if carried is not None else self.masks_for(kwargs)
        chunk = self.restriction(module, attention_mask).chunk
        if chunk is not None:   # chunked attention: chunks of the global token index are documents
            masks = hf_mask_probe.with_chunks(masks, chunk, query.shape[0], query.shape[2] * self.mesh.size())
        args = self._core_args(module, query, key, value, attention_mask, scaling, dropout, kwargs, masks)
        if masks is None:   # contiguous BSHD, as transformers' attention functions return (AFMoE views it)
            return self.core(*args).transpose(1, 2).contiguous(), None
        # entered per call (not across the whole forward): a forward that raises leaves no context behind
        with attention_masks(**masks):
            return self.core(*args).transpose(1, 2).contiguous(), None

    def start(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              scaling: Optional[float] = None, dropout: float = 0.0, **kwargs: Any) -> Any:
        """The same call as a pending one (``start_attention``: its collective travels until
        ``finish()``, which gives the local block in BNSD); only where no mask is active (hf_overlap.py
        checks)."""
        args = self._core_args(module, query, key, value, None, scaling, dropout, kwargs, None)
        return start_attention(self.core, *args)

    def learn_mask(self, module: torch.nn.Module, attention_mask: Any) -> None:
        """During the audit: what the mask the model built for ``module`` restricts (hf_mask_probe.py)."""
        if attention_mask is None or module in self.restrictions:   # the first (unpadded) probe run decides
            return
        if not isinstance(attention_mask, hf_mask_probe.MaskSpec):
            raise ValueError(f"parallelize_model: {type(module).__name__} hands its attention a prepared "
                             f"mask tensor (e.g. a positional bias), which context parallelism does not "
                             f"split")
        restriction, why = hf_mask_probe.classify(attention_mask, self.mask_grid)
        if restriction is None:
            raise ValueError(f"parallelize_model: the attention mask {type(self.model()).__name__} builds "
                             f"for {type(module).__name__} restricts attention in a way context parallelism "
                             f"does not reproduce: {why}; train this model without a 'cp' mesh dim")
        self.restrictions[module] = restriction

    def restriction(self, module: torch.nn.Module, attention_mask: Any) -> Any:
        """The restriction the model's mask puts on ``module``'s attention (plain causal without a mask)."""
        if attention_mask is None:
            return hf_mask_probe.CAUSAL
        if not isinstance(attention_mask, hf_mask_probe.MaskSpec):
            raise ValueError("parallelize_model: the attention received a prepared mask tensor; under "
                             "context parallelism pass the 2-D padding attention_mask (this rank's block) "
                             "instead")
        known = self.restrictions.get(module)
        if known is None:   # not met by the audit (a dry run): the mask carries no padding / packing yet
            if get_platform().is_fake(next(self.model().parameters())):
                # a dry run (hyper_parallel.plan, fake tensors): the mask function cannot be evaluated
                # on values; plain causal attention is assumed (docs/planning.md)
                self.restrictions[module] = hf_mask_probe.CAUSAL
            else:
                self.learn_mask(module, attention_mask)
            known = self.restrictions[module]
        return known

    def forward_masks(self) -> "dict | None":
        """This forward's global masks for the MaskSpecs the model builds ({}: none; None: no forward)."""
        return dict(self.masks or {}) if self.in_forward else None

    def masks_for(self, kwargs: Dict[str, Any]) -> Optional[Dict[str, Any]]:
        """The masks of the forward this attention call belongs to (see the class docstring)."""
        positions = kwargs.get("position_ids")
        filed = self._by_positions.get(id(positions))
        if filed is not None and filed[0]() is positions:
            return filed[1]
        if self.in_forward:
            return self.masks
        if all(masks is None for _, masks in self._by_positions.values()):
            return None   # no live forward had masks: none can be missed (e.g. a layer called directly)
        raise ValueError("parallelize_model: an attention call outside the model's forward (activation "
                         "checkpointing recomputing a layer?) without that forward's position_ids, so its "
                         "padding / packing masks cannot be found; pass position_ids on to the attention "
                         "as transformers' Llama-family layers do")

    def _core_args(self, module, query, key, value, attention_mask, scaling, dropout, kwargs, masks):
        restriction = self.restriction(module, attention_mask)
        check_attention_kwargs(module, kwargs)
        causal = kwargs.get("is_causal")
        causal = getattr(module, "is_causal", True) if causal is None else causal
        if isinstance(attention_mask, hf_mask_probe.MaskSpec) and self.mask_decides:
            causal = restriction.causal   # the model ran an implementation that always applies its mask
        causal = bool(causal) and restriction.causal
        gqa = query.shape[1] != key.shape[1]
        total = query.shape[2] * self.mesh.size()
        variant = attention_variant(module, kwargs, total)
        if restriction.window is not None and restriction.window < total:
            window = restriction.window if variant[2] is None else min(variant[2], restriction.window)
            variant = variant[:2] + (window,)
        if (masks is not None or any(x is not None for x in variant)) and dropout:
            raise ValueError(f"parallelize_model: attention dropout {dropout} with a padding mask, packed "
                             f"position_ids, soft-capping, sinks or a sliding window under context "
                             f"parallelism is not supported (those kernels take none); set the config's "
                             f"attention_dropout=0 or call model.eval()")
        return (query, key, value, scaling, dropout, causal, gqa) + variant

    # ------------------------------------------------------------------ once per forward
    def audit(self) -> None:
        """Refuse the model if a module other than attention mixes the sequence (every rank alike)."""
        self.audit_pending, self.probing = False, True
        model = self.model()
        if get_platform().is_fake(next(model.parameters())):
            # a dry run (hyper_parallel.plan) has no values to compare: the audit is left to a real run
            self.probing = False
            return
        try:
            with kept_state(model):   # no trace of the probes left (a dynamic RoPE's cached length)
                refuse_sequence_mixing(model)
                # where positions enter (hf_positions.py): their hooks pass through while probing
                entry = _entry_parameters(model)
                self.sources = hf_positions.position_sources(model, entry)
                self.entry_offset = hf_positions.entry_offset(self.sources)
                self.source_hooks = hf_positions.install(self.sources, lambda: self.context)
                hf_positions.refuse_block_differences(model, entry, lambda c: setattr(self, "context", c),
                                                      self.entry_offset, self._block_start)
                self.packs = self._probe_packing(model, entry)
        finally:
            self.probing = False

    def _probe_packing(self, model: torch.nn.Module, entry: Any) -> bool:
        """Whether the model's own masks separate packed documents (Llama's do; OPT's, BioGPT's and
        gpt-oss's do not hand their position_ids to the mask), so that CP does exactly what they do."""
        if "position_ids" not in entry:
            return False
        self.seen_masks = []
        try:
            hf_positions.run_packed(model, entry, 7)
        except Exception:   # the model does not run on packed positions here: documents as before
            return True
        finally:
            seen, self.seen_masks = self.seen_masks, None
        specs = [m for m in seen if isinstance(m, hf_mask_probe.MaskSpec)]
        # no mask reached the stand-in (MLA's own attention path reads the masks itself): as before
        return not specs or any(hf_mask_probe.separates_documents(m, 7) for m in specs)

    def decoder_entered(self, module: torch.nn.Module, args: Any) -> None:
        """The decoder's pre-hook: the model's forward is running; it must have entered through the
        wrapped model's call, whose hooks make positions and masks global."""
        if not (self.in_forward or self.probing or self.disabled):
            raise ValueError(f"parallelize_model: {type(module).__name__} ran without context parallelism's "
                             f"per-forward hooks (model.forward(...) or model.model(...) called directly): "
                             f"positions and masks would be each rank's own; call the model: model(...)")

    def _block_start(self, local: int) -> int:   # this rank's first token (hf_block_cache.py)
        return self.context.start if self.context is not None else self.mesh.get_local_rank() * local

    def pre_forward(self, module: torch.nn.Module, args: Any, kwargs: Dict[str, Any]) -> Any:
        if self.probing or self.disabled:   # the audit, or verify=True's run without CP (hf_verify.py)
            return args, kwargs
        if self.audit_pending:
            self.audit()
        self.forwards += 1
        try:
            hf_cp_inputs.check_attention_kept(module, self.name)
            batch, local, positions = hf_cp_inputs.local_inputs(self.mesh, args, kwargs)
            problem = None
        except ValueError as error:
            batch = local = 0
            problem = error
        flags = [int(kwargs.get(n) is not None) for n in ("attention_mask", "position_ids")]
        row = [batch, local, *flags, int(torch.is_grad_enabled()), self.forwards]
        hf_cp_inputs.check_ranks_agree(self.mesh, module, row, problem)
        asked = {"use_cache": kwargs.get("use_cache")}   # before use_cache is turned off below

        def cached() -> bool:   # asked only for packed documents (it may walk the model's modules)
            return hf_cp_inputs.would_use_cache(module, asked)
        accepted = _entry_parameters(module)
        if "use_cache" in accepted:
            kwargs["use_cache"] = False
        given = kwargs.get("position_ids") is not None
        every = hf_cp_inputs.gather(self.mesh, positions.expand(batch, -1)).cpu() if given else None
        total = local * self.mesh.size()
        self.context = hf_positions.PositionContext(torch.arange(total)[None] if every is None else every,
                                                    self.mesh.get_local_rank() * local, local, given)
        # this forward's own tensor object (masks_for); RoBERTa-style entries count from padding_idx + 1
        positions = positions.view(positions.shape) if given else positions + self.entry_offset
        if "position_ids" in accepted:
            kwargs["position_ids"] = positions
        mask = kwargs.get("attention_mask")
        self.masks = hf_cp_inputs.global_masks(self.mesh, mask, every, self.packs, cached)
        if self.masks and "document_ids" in self.masks and any(r.chunk for r in self.restrictions.values()):
            hf_cp_inputs.check_documents_from_zero(every, self.masks["document_ids"])
        counted = hf_positions.padding_dependent(self.sources)
        if counted and not given and self.masks is not None and "padding_mask" in self.masks:
            raise ValueError(f"parallelize_model: {type(module).__name__} counts positions from the padding "
                             f"mask ({', '.join(counted)}), which one rank's block cannot count; pass "
                             f"position_ids (this rank's block of the global ones) with a padded "
                             f"attention_mask")
        key = id(positions)
        self._by_positions[key] = (weakref.ref(positions), self.masks)
        weakref.finalize(positions, self._by_positions.pop, key, None)   # gone with the forward's graph
        self.in_forward = True
        self.source_calls = [hook.calls for hook in self.source_hooks]
        return args, kwargs

    def post_forward(self, module: torch.nn.Module, args: Any, kwargs: Dict[str, Any], output: Any) -> Any:
        local = self.context.local if self.context is not None else None
        # recomputations find their masks by position_ids
        self.masks, self.in_forward, self.context = None, False, None
        if local is not None:
            hf_cp_inputs.check_sequence_output(module, output, local)
            hf_cp_inputs.check_sources_kept(module, self.source_hooks, self.source_calls)
        return output


def _autocast(query, key, value):
    """q, k, v in autocast's dtype where it is on, as sdpa casts them in one process (rotary embeddings
    leave q and k in float32 while v is bfloat16); as they are otherwise."""
    device = query.device.type
    if not torch.is_autocast_enabled(device):
        return query, key, value
    dtype = torch.get_autocast_dtype(device)
    return query.to(dtype), key.to(dtype), value.to(dtype)


def _token_local_attention(query, key, value):
    """The audit's stand-in: each query token gets its own value plus the means of its own query and key
    (so that whatever scales q or k, e.g. an attention temperature, shows), heads repeated for GQA; a
    contiguous BSHD tensor, as sdpa's is after the model's transpose."""
    repeat = query.shape[1] // value.shape[1]
    own = (value + key.mean(-1, keepdim=True).to(value.dtype)).repeat_interleave(repeat, dim=1)
    out = own + query.mean(-1, keepdim=True).to(value.dtype)
    return out.transpose(1, 2).contiguous()


def _entry_parameters(module):
    """The named parameters of ``module``'s forward (the model's entry)."""
    import inspect
    try:
        parameters = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):
        return frozenset()
    return frozenset(p.name for p in parameters if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL))


def _decoder(model):
    """The model's decoder (LlamaModel, OPT's decoder) when it is a submodule, else None."""
    try:
        decoder = model.get_decoder()
    except (AttributeError, NotImplementedError, ValueError, TypeError):
        return None
    return decoder if isinstance(decoder, torch.nn.Module) and decoder is not model else None


def _own_config(model):
    """Give the model a config of its own before switching its attention implementation: a config
    object shared with another model (built from the same config) would switch that one too."""
    old = model.config
    new = copy.deepcopy(old)
    for module in model.modules():
        if module.__dict__.get("config") is old:
            module.config = new


def prepare_context_parallel(model: Any, cp_mesh: Any, cp_kwargs: Dict[str, Any]) -> "CPAttention":
    """Switch the model's attention to the CP attention function and audit the model (before any
    tensor parallelism, so that the audit's runs need no collective). Returns the state."""
    from transformers import AttentionInterface

    _own_config(model)
    state = CPAttention(model, cp_mesh, cp_kwargs)
    AttentionInterface.register(state.name, state)
    # the model's masks come back unbuilt (hf_mask_probe.MaskSpec), carrying this forward's global masks
    hf_mask_probe.register(state.name, state.forward_masks)
    model.set_attn_implementation(state.name)
    if model.config._attn_implementation != state.name:
        raise ValueError(f"parallelize_model: {type(model).__name__} does not accept a custom attention "
                         f"implementation (transformers' AttentionInterface), so context parallelism cannot "
                         f"be applied")
    if any(p.is_meta for p in model.parameters()):
        state.audit_pending = True   # no values to run yet: audited at the first forward
    else:
        state.audit()
    return state


def apply_context_parallel(model: Any, state: "CPAttention", cp_kwargs: Dict[str, Any]) -> Any:
    """The per-forward hooks (global masks and positions) and, with ``overlap``, the pipelined blocks."""
    # on the model itself, where every call enters (OPT's and BART-style *ForCausalLM call their decoder
    # directly, not model.base_model); positions are fixed where the model's sources read them
    model.register_forward_pre_hook(state.pre_forward, with_kwargs=True)
    model.register_forward_hook(state.post_forward, with_kwargs=True)
    decoder = _decoder(model)
    if decoder is not None:   # a forward that skipped the hooks above is refused
        decoder.register_forward_pre_hook(state.decoder_entered)
    model._hp_cp_attention = state
    if cp_kwargs.get("overlap"):   # q/k/v projections overlap the collectives too (hf_overlap.py)
        pipeline_attention_blocks(model, state, cp_kwargs, state.mesh.size())
    return model
