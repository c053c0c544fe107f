"""Tensor parallelism for Hugging Face models from their own TP plan (``model.tp_plan``, which holds
``config.base_model_tp_plan`` under the base model's prefix plus the head's ``_tp_plan``).

HF names styles by strings; each is translated to this library's style with the same layouts
(transformers 5, ``transformers.distributed.tensor_parallel``):

- ``colwise``: Colwise, input replicated, output ``Shard(-1)`` (local heads for q/k/v)
- ``rowwise``: Rowwise, input ``Shard(-1)``, output replicated (one all-reduce)
- ``colwise_rep`` / ``colwise_gather_output``: Colwise with the output gathered (e.g. ``lm_head``)
- ``rowwise_rep`` / ``rowwise_split_input``: Rowwise taking a replicated input
- ``embedding_rowwise`` / ``embedding_colwise``: an Embedding split by vocabulary / by hidden dim
- ``sequence_parallel``: SequenceParallel returning local sequence shards
- ``replicate``: left whole on every rank
- ``replicated_with_grad_allreduce``: a per-head norm (Qwen3 ``q_norm``/``k_norm``) on this rank's
  heads; its replicated weight gets the gradient summed over the TP ranks

Attention modules in transformers 5 reshape projections with ``view(..., -1, head_dim)``, so they
pick up the per-rank head count from the sharded projection by themselves (as under HF's own TP);
integer head-count attributes that some modules keep are divided by the TP size as well.
"""
from typing import Any
import fnmatch

from hyper_parallel.core.dtensor.placement_types import Replicate, Shard
from hyper_parallel.core.tensor_parallel import (ColwiseParallel, ParallelStyle, RowwiseParallel,
                                                 SequenceParallel, parallelize_module)
from hyper_parallel.core.tensor_parallel.base import from_dtensor, replicate_parameters, to_dtensor
from hyper_parallel.integrations.hf_mla_tensor_parallel import mla_kv_a_proj_style

_HEAD_ATTRS = ("num_heads", "num_attention_heads", "num_key_value_heads", "num_kv_heads")


class _PerHeadNorm(ParallelStyle):
    """A norm applied to this rank's heads (``(..., heads, head_dim)``): the weight is a replicated
    DTensor and the input is taken as split on the head dim, so the weight's gradient is the sum
    over the TP ranks (HF's "replicated_with_grad_allreduce")."""

    def apply(self, module, device_mesh):
        replicate_parameters(module, device_mesh, self.src_data_rank)
        heads = Shard(-2)

        def pre_hook(mod, args):
            return (to_dtensor(args[0], device_mesh, heads, heads),) + tuple(args[1:])

        def post_hook(mod, args, output):
            return from_dtensor(output, device_mesh, None, True)
        module.register_forward_pre_hook(pre_hook)
        module.register_forward_hook(post_hook)
        return module


def _styles():
    return {
        "colwise": ColwiseParallel,
        "rowwise": RowwiseParallel,
        "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
        "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
        "rowwise_rep": lambda: RowwiseParallel(input_layouts=Replicate()),
        "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
        "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),
        "embedding_colwise": lambda: ColwiseParallel(output_layouts=Replicate()),
        "sequence_parallel": lambda: SequenceParallel(use_local_output=True),
        "replicated_with_grad_allreduce": _PerHeadNorm,
        "replicate": None,
    }


def translate_plan(hf_plan: Any, config: Any = None) -> Any:
    """{fqn pattern: our style} from HF's {fqn pattern: style name}; unknown names raise.
    ``config``: for styles that read it (``mla_kv_a_proj``: the rotary width)."""
    table, plan = _styles(), {}
    if config is not None and "mla_kv_a_proj" in hf_plan.values():
        table["mla_kv_a_proj"] = mla_kv_a_proj_style(config)
    for pattern, name in hf_plan.items():
        if name not in table:
            raise ValueError(f"parallelize_model: the model's TP plan uses {name!r} for {pattern!r}, which "
                             f"hyper_parallel does not translate (supported: {sorted(table)}); pass tp=None "
                             f"to skip tensor parallelism")
        if table[name] is not None:
            plan[pattern] = table[name]()
    return plan


def _check_heads(config, tp):
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for attr in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(text, attr, None)
        if isinstance(heads, int) and heads % tp:
            raise ValueError(f"parallelize_model: {attr}={heads} is not divisible by the TP size {tp}; "
                             f"choose a TP size that divides the head counts")


def _style_name(hf_plan, fqn):
    """The HF style name the plan gives module ``fqn`` (fnmatch per dotted segment), or None."""
    atoms = fqn.split(".")
    for pattern, name in hf_plan.items():
        parts = pattern.split(".")
        if len(parts) == len(atoms) and all(fnmatch.fnmatchcase(a, p) for a, p in zip(atoms, parts)):
            return name
    return None


def _localize_head_counts(model, hf_plan, tp):
    """Divide per-module integer head counts by ``tp`` in attention modules whose q (or fused qkv)
    projection returns this rank's heads. A plan that gathers the projection's output (Phi-3's
    ``qkv_proj``: ``colwise_gather_output``) hands every rank all heads, so their counts stay.
    Modules that infer heads with ``view(..., -1, head_dim)`` need nothing."""
    for name, module in model.named_modules():
        proj = "q_proj" if hasattr(module, "q_proj") else "qkv_proj" if hasattr(module, "qkv_proj") else None
        if proj is None or _style_name(hf_plan, f"{name}.{proj}") != "colwise":
            continue
        for attr in _HEAD_ATTRS:
            value = module.__dict__.get(attr)
            if isinstance(value, int) and not isinstance(value, bool):
                setattr(module, attr, value // tp)


def _retie(model, tied_before):
    """Tied input/output embeddings stay one parameter when both were split the same way."""
    if not tied_before:
        return
    inp, out = model.get_input_embeddings(), model.get_output_embeddings()
    if out is None or inp is None:
        return
    a, b = getattr(inp.weight, "placements", None), getattr(out.weight, "placements", None)
    if a is not None and a == b:
        out.weight = inp.weight
    elif a is not None or b is not None:
        raise ValueError("parallelize_model: the model ties its input and output embeddings but its TP plan "
                         "splits them differently; untie them (tie_word_embeddings=False) or use tp=None")


def apply_tensor_parallel(model: Any, tp_mesh: Any) -> Any:
    hf_plan = dict(getattr(model, "tp_plan", None) or {})
    if not hf_plan:
        prefix = model.base_model_prefix
        base = getattr(model.config, "base_model_tp_plan", None) or {}
        hf_plan = {f"{prefix}.{k}": v for k, v in base.items()}
        hf_plan.update(getattr(model, "_tp_plan", None) or {})
    if not hf_plan:
        raise ValueError(f"parallelize_model: {type(model).__name__} has no tensor-parallel plan "
                         f"(config.base_model_tp_plan); pass tp=None")
    tp = tp_mesh.size()
    _check_heads(model.config, tp)
    inp, out = model.get_input_embeddings(), model.get_output_embeddings()
    tied = inp is not None and out is not None and inp.weight is out.weight
    parallelize_module(model, tp_mesh, translate_plan(hf_plan, model.config))
    _retie(model, tied)
    _localize_head_counts(model, hf_plan, tp)
    return model
