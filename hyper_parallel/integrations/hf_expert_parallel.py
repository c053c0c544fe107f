"""Expert parallelism inside ``parallelize_model(..., ep="dp_shard")`` or ``ep=("dp_shard", "cp")``.

Every MoE block's stacked experts are split over the ep ranks (``ExpertParallel``); those ranks keep
their own tokens (data / sequence blocks). What remains of the data ranks (the fully_shard mesh's
dims minus the ep dims) shards the expert parameters with fully_shard, one unit per experts module,
before parallelize_model shards the decoder layers (fully_shard leaves expert-parallel modules to
their own unit). Routers and shared experts stay with their layer.

The router's load-balancing loss is recomputed over the global tokens of the data ranks
(``load_balancing_loss``): the model's forward runs with ``output_router_logits=False`` and the
router logits are captured by forward hooks, so no rank-local auxiliary loss is computed.
"""
import functools
import math
from typing import Any, List, Sequence, Tuple

from hyper_parallel.core.agreement import check_agreement
from hyper_parallel.core.expert_parallel import ExpertParallel, load_balancing_loss
from hyper_parallel.core.expert_parallel.experts import is_stacked_experts
from hyper_parallel.core.expert_parallel.module_list import list_experts
from hyper_parallel.core.expert_parallel.settings import ROUTING_ATTRS, routing_settings
from hyper_parallel.core.expert_parallel.style import validate_degrees
from hyper_parallel.core.fully_shard import fully_shard
from hyper_parallel.platform import get_platform

_NUM_EXPERTS = ("num_experts", "num_local_experts", "n_routed_experts")
_TOP_K = ("num_experts_per_tok", "num_experts_per_token")


def _config_int(config: Any, names: Sequence[str]) -> int:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return 0


def ep_dims(mesh: Any, ep: Any) -> Tuple[str, ...]:
    """The ep mesh dims as a tuple; a ValueError naming a dim the mesh lacks."""
    dims = (ep,) if isinstance(ep, str) else tuple(ep) if isinstance(ep, (tuple, list)) else None
    if not dims or not all(isinstance(d, str) for d in dims) or len(set(dims)) != len(dims):
        raise ValueError(f"parallelize_model(ep={ep!r}): pass a mesh dim name or a tuple of distinct names, "
                         f"e.g. ep='dp_shard' or ep=('dp_shard', 'cp')")
    names = tuple(mesh.mesh_dim_names or ())
    missing = [d for d in dims if d not in names]
    if missing:
        raise ValueError(f"parallelize_model(ep={ep!r}): the mesh {names} has no {missing[0]!r} dim; name an "
                         f"existing dim (mesh_dim_names=...)")
    return dims


def _moe_blocks(model: Any) -> List[Any]:
    """Modules holding a child ``experts``: stacked (Hugging Face 5.x) or a per-expert list."""
    platform = get_platform()
    return [module for _, module in platform.named_modules(model)
            if list_experts(module) is not None or any(name == "experts" and is_stacked_experts(child)
                                                       for name, child in platform.named_children(module))]


def _expert_count(block: Any) -> int:
    listed = list_experts(block)
    if listed is not None:
        return len(list(get_platform().named_children(listed)))
    return int(dict(get_platform().named_parameters(block.experts))["gate_up_proj"].shape[0])


def _sub(mesh: Any, dims: Sequence[str]) -> Any:
    if not dims:
        return None
    if mesh.ndim == len(dims) == 1:
        return mesh
    sub = mesh[dims[0]] if len(dims) == 1 else mesh[tuple(dims)]
    return sub if sub.ndim == 1 else sub.flatten("_".join(dims))


def _experts_in_tp_plan(model: Any) -> List[str]:
    plan = getattr(getattr(model, "config", None), "base_model_tp_plan", None) or {}
    return sorted(key for key in plan if ".experts" in key)


def check_expert_parallel(model: Any, mesh: Any, ep: Any, data_parallel: bool = True,
                          tensor_parallel: bool = False) -> Tuple[str, ...]:
    """Every check that needs no communication: the dims, the expert count against the ep size,
    top-k against the expert count, and that the model has stacked experts at all."""
    dims = ep_dims(mesh, ep)
    if not data_parallel:
        raise ValueError(f"parallelize_model(ep={ep!r}) needs the mesh's dp_shard dim: the non-expert "
                         f"gradients are reduced by fully_shard (data_parallel would all-reduce the split "
                         f"experts too); name the data dim 'dp_shard' or pass dp_shard=")
    if tensor_parallel and _experts_in_tp_plan(model):
        raise ValueError(f"parallelize_model(ep={ep!r}): the model's TP plan also splits the experts "
                         f"({_experts_in_tp_plan(model)}); expert tensor parallelism is not supported, "
                         f"drop tp= or ep=")
    size = math.prod(mesh[d].size() if mesh.ndim > 1 else mesh.size() for d in dims)
    config = getattr(model, "config", None)
    num, top_k = _config_int(config, _NUM_EXPERTS), _config_int(config, _TOP_K)
    blocks = _moe_blocks(model)
    if not blocks:
        raise ValueError(f"parallelize_model(ep={ep!r}): {type(model).__name__} has no MoE layer (an "
                         f"'experts' module with 3-D gate_up_proj / down_proj, or a per-expert list)")
    validate_degrees(num or _expert_count(blocks[0]), size, top_k)
    listed = any(list_experts(block) is not None for block in blocks)
    if listed and getattr(config, "output_router_logits", False):
        # the global load-balancing loss reads HF 5.x routers' logits (their first output)
        raise ValueError(f"parallelize_model(ep={ep!r}): {type(model).__name__} holds per-expert lists and "
                         f"asks for router logits (output_router_logits=True); the global auxiliary loss is "
                         f"wired for stacked Hugging Face 5.x layers only: set output_router_logits=False")
    _check_routing_agreement(model, mesh, blocks)
    return dims


def _check_routing_agreement(model: Any, mesh: Any, blocks: List[Any]) -> None:
    """Every rank of the mesh builds the same routing (experts, top-k, normalisation, scaling,
    grouping, the auxiliary-loss coefficient): one small exchange before any parameter moves, so
    ranks that disagree all raise a ValueError naming the setting."""
    config = getattr(model, "config", None)
    settings = {f"config.{name}": getattr(config, name) for name in
                ROUTING_ATTRS + _NUM_EXPERTS + _TOP_K + ("output_router_logits",)
                if isinstance(getattr(config, name, None), (bool, int, float, str))}
    coef = getattr(model, "router_aux_loss_coef", None)
    if isinstance(coef, (int, float)):
        settings["model.router_aux_loss_coef"] = coef
    settings["moe_layers"] = len(blocks)
    settings["experts_per_layer"] = tuple(_expert_count(block) for block in blocks)
    for name, value in routing_settings(blocks[0]).items():
        settings[f"layer0.{name}"] = value
    check_agreement(mesh, "expert_parallel_model", settings, once=False,
                    fix="build the model from the same config (experts, top-k, routing flags, "
                        "router_aux_loss_coef) on every rank")


def apply_expert_parallel(model: Any, mesh: Any, ep: Any, data_dims: Sequence[str],
                          average: bool) -> Any:
    """Split the experts over ``ep``, fully_shard them over ``data_dims`` minus ``ep`` and make the
    load-balancing loss global over ``data_dims``."""
    dims = check_expert_parallel(model, mesh, ep)
    names = tuple(mesh.mesh_dim_names or ())
    data_dims = [d for d in data_dims if d is not None and d in names]
    _check_data_dims(mesh, ep, dims, data_dims)
    ep_mesh = _sub(mesh, dims)
    rest = _sub(mesh, [d for d in data_dims if d not in dims and mesh[d].size() > 1])
    for block in _moe_blocks(model):
        # applied to the block: its router's settings join the per-call agreement check
        ExpertParallel(average=average).apply(block, ep_mesh)
        if rest is None:
            continue
        state = block.experts._hp_expert_parallel
        # a per-expert list is never called itself: each local expert is its own fully_shard unit
        for unit in state.local_modules or (block.experts,):
            fully_shard(unit, rest, average=average)
    data_mesh = _sub(mesh, list(dict.fromkeys(list(data_dims) + list(dims))))
    _global_aux_loss(model, data_mesh.get_group(0), 1 if average else data_mesh.size())
    return model


def global_aux_loss(model: Any, mesh: Any, data_dims: Sequence[str], average: bool) -> None:
    """Without ``ep=`` (experts replicated): the load-balancing loss over the global tokens of the data
    ranks, as with ``ep=``. Hugging Face's own is each rank's batch / sequence block alone, a product
    of two means whose mean over the ranks is another loss (router gradients off by 3e-3 under CP)."""
    names = tuple(mesh.mesh_dim_names or ())
    dims = [d for d in data_dims if d is not None and d in names and mesh.size(names.index(d)) > 1]
    blocks = _moe_blocks(model)
    # stacked (Hugging Face 5.x) layers only: their routers' first output is the logits
    if dims and blocks and all(hasattr(b, "experts") and is_stacked_experts(b.experts) for b in blocks):
        data_mesh = _sub(mesh, dims)
        _global_aux_loss(model, data_mesh.get_group(0), 1 if average else data_mesh.size())


def _check_data_dims(mesh: Any, ep: Any, dims: Sequence[str], data_dims: Sequence[str]) -> None:
    """The ep ranks must be data ranks (they keep their own tokens, whose gradients fully_shard
    reduces), and no data dim may escape the experts' reduction (HSDP's dp_replicate is not wired)."""
    outside = [d for d in dims if d not in data_dims]
    if outside:
        raise ValueError(f"parallelize_model(ep={ep!r}): {outside[0]!r} is not a data dim of this call "
                         f"({tuple(data_dims)}: fully_shard reduces the gradients over those only); split "
                         f"the experts over dp_shard and/or cp")
    names = tuple(mesh.mesh_dim_names or ())
    if "dp_replicate" in names and mesh["dp_replicate"].size() > 1:
        raise ValueError(f"parallelize_model(ep={ep!r}) with a dp_replicate dim (HSDP) is not supported: "
                         f"the split experts' gradients would not be reduced over the replicas; fold "
                         f"dp_replicate into dp_shard")


def _routers(model: Any) -> List[Any]:
    found = []
    for block in _moe_blocks(model):
        router = getattr(block, "gate", None) or getattr(block, "router", None)
        if router is not None:
            found.append(router)
    return found


def _global_aux_loss(model: Any, group: Any, share: int) -> None:
    """Route the model's auxiliary loss through ``load_balancing_loss`` over ``group``. Each rank
    adds ``coef · aux / share``: the whole term where the ranks' losses are averaged, a 1 / R share
    where they are summed (``average=False``: the losses add up to the global loss)."""
    config = getattr(model, "config", None)
    coef = getattr(model, "router_aux_loss_coef", None)
    if coef is None or not hasattr(config, "output_router_logits"):
        return   # DeepSeek-V3 / Kimi-Linear: no auxiliary loss (bias-based balancing)
    platform, routers = get_platform(), _routers(model)
    num, top_k = _config_int(config, _NUM_EXPERTS), _config_int(config, _TOP_K)

    def wrap(original):
        # the model's own signature stays visible (wraps): context parallelism's entry hook reads it to
        # pass use_cache=False and the global position_ids
        @functools.wraps(original)
        def forward(*args, **kwargs):
            want = kwargs.pop("output_router_logits", None)
            if not (config.output_router_logits if want is None else want):
                return original(*args, output_router_logits=False, **kwargs)
            captured = []
            hooks = [platform.register_forward_hook(r, lambda _m, _i, out: captured.append(out[0]))
                     for r in routers]
            try:
                out = original(*args, output_router_logits=False, **kwargs)
            finally:
                for hook in hooks:
                    hook.remove()
            mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
            # read at each call, as Hugging Face's forward reads its own attributes (a coefficient
            # schedule, a changed top-k); the ranks must agree on them (one exchange when they change)
            now = _aux_settings(model, coef, num, top_k)
            check_agreement(group, "expert_parallel_aux_loss", now,
                            fix="set router_aux_loss_coef / num_experts_per_tok alike on every rank")
            aux = load_balancing_loss(captured, now["num_experts"], now["top_k"], group, mask)
            out["aux_loss"], out["router_logits"] = aux, tuple(captured)
            if out.loss is not None:
                out["loss"] = out.loss + (now["router_aux_loss_coef"] / share) * aux
            return out
        return forward
    platform.replace_forward(model, wrap)


def _aux_settings(model: Any, coef: float, num: int, top_k: int) -> dict:
    """The auxiliary loss's coefficient, expert count and top-k as the model holds them now (the
    attributes Hugging Face's forward passes to ``load_balancing_loss_func``); the values found at
    ``parallelize_model`` where the model has no such attribute."""
    def now(name: str, default: Any) -> Any:
        value = getattr(model, name, None)
        return value if isinstance(value, (int, float)) and not isinstance(value, bool) else default
    return {"router_aux_loss_coef": float(now("router_aux_loss_coef", coef)),
            "num_experts": int(now("num_experts", num)), "top_k": int(now("num_experts_per_tok", top_k))}
