"""ExpertParallel: a Mixture-of-Experts layer's experts split over an ``ep`` mesh (SPEC §17).

    ExpertParallel().apply(moe_block_or_experts, mesh["ep"])

The stacked expert tensors become DTensors sharded on the expert dim (rank r holds experts
[r·E/ep, (r+1)·E/ep)); the router (outside the experts module) stays replicated, shared experts stay
dense. The experts module's forward keeps its Hugging Face signature ``(hidden_states, top_k_index,
top_k_weights)`` and dispatches each rank's own tokens (dispatch.py). A block whose ``experts`` is a
per-expert module list keeps this rank's E/ep experts and gets a routing forward (module_list.py).
The ranks' routing settings (settings.py) are compared at apply and whenever they change.

Gradients: an expert's gradient arrives summed over every ep rank's loss. With ``average=True``
(data parallelism averages the other gradients over the data ranks) it is scaled by 1 / ep; a
fully_shard over the remaining data ranks then averages over those. ``average=False`` keeps the sum
(a loss normalised by the global token count).
"""
from typing import Any, Callable, Dict, Optional, Tuple

from hyper_parallel.core.agreement import check_agreement
from hyper_parallel.core.bounded_cache import lifetime_key
from hyper_parallel.core.dtensor.device_mesh import DeviceMesh
from hyper_parallel.core.dtensor.dtensor import DTensor
from hyper_parallel.core.dtensor.placement_types import Shard
from hyper_parallel.core.expert_parallel.dispatch import GradScale, dispatch_combine
from hyper_parallel.core.expert_parallel.experts import (check_layout, expert_parameter_names, find_experts,
                                                         grouped_compute)
from hyper_parallel.core.expert_parallel.module_list import (block_top_k, check_list_layout, is_expert_list,
                                                             keep_local, list_compute, list_experts, route,
                                                             shared_output)
from hyper_parallel.core.expert_parallel.settings import routing_settings
from hyper_parallel.core.tensor_parallel.base import ParallelStyle, shard_parameters
from hyper_parallel.core.typing import Module, Tensor
from hyper_parallel.platform import get_platform

_SETTINGS = ("num_experts", "top_k", "hidden", "dtype", "average", "ep")


def _router_top_k(module: Any) -> int:
    for name in ("gate", "router"):
        child = getattr(module, name, None)
        top_k = getattr(child, "top_k", None)
        if isinstance(top_k, int):
            return top_k
    return 0


class ExpertState:
    """What the wrapped forward needs: the mesh, the expert count and the gradient convention."""

    def __init__(self, module: Module, mesh: DeviceMesh, num_experts: int, average: bool,
                 owner: Optional[Module] = None) -> None:
        self.module, self.mesh, self.num_experts, self.average = module, mesh, num_experts, average
        self.owner = owner           # the MoE block (router settings), when apply was given one
        self.ep = mesh.size()
        self.group = mesh.get_group(0)
        self.names = expert_parameter_names(module)     # empty for a per-expert list
        self.local_modules: Tuple[Any, ...] = ()    # a per-expert list's local experts

    def check(self, hidden: Tensor, top_k_index: Tensor) -> None:
        """Shape checks on every rank, then (first call of a signature) the ranks' agreement on the
        routing settings: one small all-reduce, so disagreeing ranks all raise instead of
        exchanging mismatched splits."""
        top_k = int(top_k_index.shape[-1])
        if top_k > self.num_experts:
            raise ValueError(f"ExpertParallel: top-k {top_k} exceeds the {self.num_experts} experts; route "
                             f"each token to at most num_experts experts")
        if int(top_k_index.shape[0]) != int(hidden.shape[0]) or len(hidden.shape) != 2:
            raise ValueError(f"ExpertParallel: hidden_states {tuple(hidden.shape)} and top_k_index "
                             f"{tuple(top_k_index.shape)} must be (tokens, hidden) and (tokens, top_k)")
        settings = dict(zip(_SETTINGS, (self.num_experts, top_k, int(hidden.shape[-1]), str(hidden.dtype),
                                        self.average, self.ep)))
        # the router's settings join the key: a rank that changes one after wrapping checks again
        settings.update(routing_settings(self.owner))
        check_agreement(self.mesh, "expert_parallel", settings, signature=lifetime_key(self),
                        fix="route with the same experts, top-k, routing flags, hidden size and dtype "
                            "on every ep rank")

    def local_parameters(self) -> Dict[str, Tensor]:
        platform = get_platform()
        local = {}
        for name, param in platform.named_parameters(self.module):
            if name not in self.names:
                continue
            tensor = param.to_local() if isinstance(param, DTensor) else param
            local[name] = GradScale(tensor, 1.0 / self.ep) if self.average and self.ep > 1 else tensor
        return local


def _make_forward(state: ExpertState):
    def wrap(original):
        def forward(hidden_states: Any, top_k_index: Any, top_k_weights: Any) -> Any:
            state.check(hidden_states, top_k_index)
            local = state.local_parameters()
            return dispatch_combine(hidden_states, top_k_index, top_k_weights, state.num_experts, state.group,
                                    state.ep, lambda rows, counts: grouped_compute(state.module, local, rows,
                                                                                   counts))
        forward.__wrapped__ = original
        return forward
    return wrap


def _make_list_forward(state: ExpertState, route_fn: Optional[Callable]):
    """The MoE block's forward for a per-expert list (module_list.py): route, dispatch to the local
    experts, add the shared experts."""
    block = state.owner

    def wrap(original):
        def forward(hidden_states: Any, *args: Any, **kwargs: Any) -> Any:
            shape = tuple(hidden_states.shape)
            flat = hidden_states.reshape(-1, shape[-1])
            index, weights, logits = route(block, flat, route_fn)
            state.check(flat, index)
            out = dispatch_combine(flat, index, weights, state.num_experts, state.group, state.ep,
                                   lambda rows, counts: list_compute(list(state.local_modules), rows, counts,
                                                                     state.ep, state.average))
            shared = shared_output(block, flat)
            out = (out if shared is None else out + shared).reshape(shape)
            return (out, logits) if logits is not None else out
        forward.__wrapped__ = original
        return forward
    return wrap


class ExpertParallel(ParallelStyle):
    """Split a MoE layer's experts over a 1-D ep mesh (a flattened one for several dims); each rank
    keeps and routes its own tokens. ``average``: see the module docstring. ``route``: for a block
    whose experts are a per-expert list, ``route(block, hidden) -> (top_k_index, top_k_weights)``
    (default: the block's router, module_list.py)."""

    def __init__(self, *, average: bool = True, route: Optional[Callable] = None) -> None:
        if not isinstance(average, bool):
            raise ValueError(f"ExpertParallel(average={average!r}): pass True or False")
        if route is not None and not callable(route):
            raise ValueError(f"ExpertParallel(route={route!r}): pass a callable (block, hidden) -> "
                             f"(top_k_index, top_k_weights), or None")
        self.average, self.route = average, route

    def apply(self, module: Module, device_mesh: DeviceMesh) -> Module:
        if device_mesh is None or getattr(device_mesh, "ndim", None) != 1:
            raise ValueError(f"ExpertParallel: pass a 1-D ep mesh (mesh['ep'], or mesh['dp_shard', 'cp']."
                             f"flatten() for several dims), got {device_mesh!r}")
        listed = list_experts(module)
        if listed is None and is_expert_list(module):
            raise ValueError(f"ExpertParallel: {type(module).__name__} is a per-expert list; apply it to "
                             f"the MoE block that owns it (the block's forward routes the tokens)")
        experts = listed if listed is not None else find_experts(module)[0]
        if getattr(experts, "_hp_expert_parallel", None) is not None:
            raise ValueError("ExpertParallel was already applied to these experts")
        owner = module if experts is not module else None
        if listed is not None:
            num = check_list_layout(module, listed)
            validate_degrees(num, device_mesh.size(), block_top_k(module))
        else:
            num = check_layout(experts)
            validate_degrees(num, device_mesh.size(), _router_top_k(module))
        # before any data moves: the ranks' routing settings (a disagreement raises on every rank)
        check_agreement(device_mesh, "expert_parallel_setup", dict(routing_settings(owner), num_experts=num),
                        once=False, fix="build the MoE layer with the same routing settings on every ep rank")
        state = ExpertState(experts, device_mesh, num, self.average, owner)
        if listed is not None:
            state.local_modules = tuple(keep_local(listed, device_mesh.get_local_rank(), device_mesh.size()))
            experts._hp_expert_parallel = state
            get_platform().replace_forward(module, _make_list_forward(state, self.route))
            return module
        names = expert_parameter_names(experts)
        shard_parameters(experts, device_mesh, {name: Shard(0) for name in names}, self.src_data_rank)
        experts._hp_expert_parallel = state
        get_platform().replace_forward(experts, _make_forward(state))
        return module


def validate_degrees(num_experts: int, ep: int, top_k: int) -> Tuple[int, int]:
    """(experts per rank, ep) or a ValueError naming the bad value; local, so every rank raises."""
    if ep < 1 or num_experts % ep:
        raise ValueError(f"ExpertParallel: {num_experts} experts are not divisible by the ep size {ep}; "
                         f"choose an ep degree that divides the expert count")
    if top_k > num_experts:
        raise ValueError(f"ExpertParallel: top-k {top_k} exceeds the {num_experts} experts")
    return num_experts // ep, ep
