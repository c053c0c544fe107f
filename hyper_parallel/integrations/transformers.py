"""Hugging Face transformers: ``parallelize_model(model, mesh, tp="tp", cp="cp", **cp_kwargs)``.

    from hyper_parallel.integrations.transformers import parallelize_model
    mesh = init_device_mesh("cuda", (dp, cp, tp), mesh_dim_names=("dp", "cp", "tp"))
    model = parallelize_model(LlamaForCausalLM(config), mesh)          # TP on "tp", CP on "cp"

Tensor parallelism comes from the model's own TP plan (hf_tensor_parallel.py), context parallelism
from an attention function registered with transformers' ``AttentionInterface``
(hf_context_parallel.py). Gradients still need ``data_parallel`` over the data and context
parallel ranks (``mesh["dp", "cp"].flatten()``): see docs/training.md.
"""
from typing import Any, Dict, Literal, Optional, Tuple, Union

from hyper_parallel.core.dtensor.device_mesh import DeviceMesh
from hyper_parallel.core.typing import Module
from hyper_parallel.integrations.hf_chunked_loss import apply_chunked_loss, check_loss_option, probe_logits
from hyper_parallel.integrations.hf_context_parallel import apply_context_parallel, prepare_context_parallel
from hyper_parallel.integrations.hf_compile import compile_decoder_layers
from hyper_parallel.integrations.hf_expert_parallel import (apply_expert_parallel, check_expert_parallel,
                                                            global_aux_loss)
from hyper_parallel.integrations.hf_fully_shard import warn_unreduced_dims
from hyper_parallel.integrations.hf_linear_attention import make_linear_attention_exact
from hyper_parallel.integrations.hf_mla import make_mla_exact
from hyper_parallel.integrations.hf_tensor_parallel import apply_tensor_parallel, translate_plan

__all__ = ["parallelize_model", "translate_plan"]


def _sub_mesh(mesh, name, role):
    if name is None:
        return None
    names = mesh.mesh_dim_names or ()
    if name not in names:
        return None
    if mesh.ndim == 1:
        return mesh
    sub = mesh[name]
    if sub.ndim != 1:
        raise ValueError(f"parallelize_model: {role} mesh dim {name!r} must be a single dim")
    return sub


def parallelize_model(model: Module, device_mesh: DeviceMesh, *, tp: Optional[str] = "tp",
                      cp: Optional[str] = "cp", dp_shard: Optional[str] = "dp_shard", average: bool = True,
                      loss: Optional[Literal["chunked"]] = None, cp_mode: Optional[Literal["auto"]] = None,
                      ep: Union[None, str, Tuple[str, ...]] = None, verify: bool = False,
                      compile: Union[bool, Dict[str, Any]] = False,
                      **context_parallel_kwargs: Any) -> Module:   # model: a transformers model
    """Tensor parallelism on mesh dim ``tp`` (the model's ``base_model_tp_plan``) and context-parallel
    attention on mesh dim ``cp`` (``context_parallel_kwargs`` go to ``ContextParallel``, e.g.
    ``ulysses_degree=1``, ``load_balance=True``, ``kv_exchange="ring"``; ``linear_attention="allgather"``
    or ``"p2p"``: how Gated DeltaNet / KDA layers pass their state, hf_linear_attention.py). A dim absent
    from the mesh (or ``None``) is skipped. Call the model with each rank's sequence block of every per-token
    input (``shard_sequence``). A ``dp_shard`` dim applies ``fully_shard`` to each decoder layer and the
    root (hf_fully_shard.py; then no data_parallel is needed), averaging the gradients over those
    ranks, or summing them with ``average=False`` (a loss normalised by the global token count).
    ``loss="chunked"``: given labels, the forward returns the loss without computing logits
    (hf_chunked_loss.py; under CP pass ``shift_labels=`` and ``num_items_in_batch=``). ``cp_mode="auto"``:
    ContextParallel chooses the mode per shape (``mode="auto"``, docs/context_parallel.md). ``compile=True``
    (or a dict of torch.compile arguments) compiles each decoder layer after parallelizing it
    (hf_compile.py, docs/compile.md). ``ep=`` (a mesh dim name or a tuple of them): MoE experts split
    over those data ranks (hf_expert_parallel.py, docs/expert_parallel.md). ``verify=True``: one probe
    batch through the model with CP on and off at setup, naming the first decoder layer that differs
    (hf_verify.py). Returns the model."""
    if getattr(model, "_hp_parallelized", False):
        raise ValueError("parallelize_model was already applied to this model")
    tp_mesh, cp_mesh, fsdp = _check_options(model, device_mesh, tp, cp, dp_shard, average, loss, verify)
    ep_dims: Tuple[str, ...] = ()
    if ep is not None:   # MoE experts split over mesh dim(s) ``ep`` (hf_expert_parallel.py, SPEC §17)
        ep_dims = check_expert_parallel(model, device_mesh, ep, fsdp, tp_mesh is not None)
    if cp_mode is not None:
        context_parallel_kwargs["mode"] = cp_mode
    if context_parallel_kwargs and cp_mesh is None:
        raise ValueError(f"parallelize_model: context-parallel options {sorted(context_parallel_kwargs)} "
                         f"given but the mesh has no {cp!r} dim")
    state = _apply_attention_parallelism(model, tp_mesh, cp_mesh, context_parallel_kwargs)
    data_dims = tuple(d for d in (dp_shard, cp) if d is not None)
    if ep is not None:
        apply_expert_parallel(model, device_mesh, ep, data_dims, average)
    else:   # replicated experts: the auxiliary loss over the global tokens all the same
        global_aux_loss(model, device_mesh, data_dims, average)
    if fsdp:
        from hyper_parallel.integrations.hf_fully_shard import apply_fully_shard
        apply_fully_shard(model, device_mesh, dp_shard, cp if cp_mesh is not None else None, average)
    if loss == "chunked":
        apply_chunked_loss(model, context_parallel=cp_mesh is not None)
    if compile:   # each decoder layer compiled, its collectives inside (hf_compile.py, docs/compile.md)
        compile_decoder_layers(model, compile)
    if verify:   # one probe batch with and without CP, layer by layer (hf_verify.py)
        from hyper_parallel.integrations.hf_verify import verify_context_parallel
        verify_context_parallel(model, state)
    # a dim whose gradients no wrapper reduces (dp without data_parallel) warns at the first forward
    reduced = {tp, *ep_dims} | ({dp_shard, cp, "dp_replicate"} if fsdp else set())
    warn_unreduced_dims(model, device_mesh, reduced)
    model._hp_parallelized = True
    return model


def _check_options(model, device_mesh, tp, cp, dp_shard, average, loss, verify):
    """The arguments that need no model change, checked before any: (tp mesh, cp mesh, fully_shard?)."""
    check_loss_option(loss)
    if loss == "chunked":   # before any parallelism: the model's own logits against hidden @ lm_head.T
        probe_logits(model)
    if not isinstance(average, bool):
        raise ValueError(f"parallelize_model(average={average!r}): pass True or False")
    tp_mesh = _sub_mesh(device_mesh, tp, "tensor-parallel")
    cp_mesh = _sub_mesh(device_mesh, cp, "context-parallel")
    fsdp = dp_shard is not None and dp_shard in (device_mesh.mesh_dim_names or ())
    if tp_mesh is None and cp_mesh is None and not fsdp:
        raise ValueError(f"parallelize_model: the mesh {device_mesh.mesh_dim_names} has neither a {tp!r}, "
                         f"a {cp!r} nor a {dp_shard!r} dim; name the mesh dims (mesh_dim_names=...) or pass "
                         f"tp=/cp=/dp_shard=")
    if not average and not fsdp:
        raise ValueError(f"parallelize_model(average=False) sets fully_shard's gradient reduction, but the "
                         f"mesh {device_mesh.mesh_dim_names} has no {dp_shard!r} dim; pass "
                         f"data_parallel(model, mesh, average=False) for replicated data parallelism")
    if verify and cp_mesh is None:
        raise ValueError(f"parallelize_model(verify=True) compares the model with and without context "
                         f"parallelism, but the mesh has no {cp!r} dim")
    return tp_mesh, cp_mesh, fsdp


def _apply_attention_parallelism(model, tp_mesh, cp_mesh, context_parallel_kwargs):
    """Context parallelism (prepared on the plain model: its audit runs no tensor-parallel
    collective), then tensor parallelism, then the CP attention; the CP state, or None."""
    # linear-attention layers (GDN, KDA) made exact on the CP blocks before the audit measures the model
    linear_mode = context_parallel_kwargs.pop("linear_attention", "allgather")
    if cp_mesh is not None:
        make_linear_attention_exact(model, cp_mesh, linear_mode, tensor_parallel=tp_mesh is not None)
        # MLA under all-gather KV: the latent travels, DSA's top-k over the global keys (hf_mla.py)
        make_mla_exact(model, cp_mesh, context_parallel_kwargs, tensor_parallel=tp_mesh is not None)
    state = prepare_context_parallel(model, cp_mesh, context_parallel_kwargs) if cp_mesh is not None else None
    if tp_mesh is not None:
        apply_tensor_parallel(model, tp_mesh)
    if state is not None:
        apply_context_parallel(model, state, context_parallel_kwargs)
    return state
