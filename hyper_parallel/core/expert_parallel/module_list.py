"""Per-expert module lists (older Hugging Face Mixtral / Qwen2-MoE, DeepSeek-V2's own code, user
models): the MoE block holds ``experts`` as a list of E modules (``experts.0`` ... ``experts.{E-1}``)
of the same structure, each called on its rows.

Splitting: rank r of the ep mesh keeps experts [r·E/ep, (r+1)·E/ep) as they are; every other entry
is replaced by an empty container of the list's own type (no parameters, never called), so indices
stay global and the state dict holds this rank's experts under their global names (DCP merges the
ranks' keys). Each rank keeps its own copy of its experts' values (no broadcast from rank 0, unlike
the stacked layout's ``distribute_tensor``): build the model with the same seed on every rank or
load a checkpoint.

The block's own forward loops over its experts, so it is replaced by a generic MoE forward: the
routing comes from ``route(block, hidden)`` when given, else from the block's router (``gate`` or
``router``): a router returning a tuple with an integer tensor gives (index, weights) as it is
(DeepSeek-V2's ``MoEGate``); one returning logits is routed as Hugging Face 4.x did — softmax in
fp32, top-k, renormalised when ``norm_topk_prob`` is true (absent: Mixtral's rule, renormalised),
cast to the hidden dtype — and the forward then returns ``(out, router_logits)`` as those blocks
did. Shared experts (``shared_expert`` / ``shared_experts``, times ``sigmoid(shared_expert_gate)``
where present) run densely on every rank.
"""
from typing import Any, Callable, List, Optional, Tuple

from hyper_parallel.core.expert_parallel.dispatch import GradScale
from hyper_parallel.platform import get_platform

_TOP_K = ("top_k", "num_experts_per_tok", "num_experts_per_token")
_SHARED = ("shared_expert", "shared_experts")
_NOISE = ("jitter_noise", "router_jitter_noise")


def is_expert_list(container: Any) -> bool:
    """A container whose children are named 0..E-1 and each hold parameters."""
    platform = get_platform()
    children = list(platform.named_children(container))
    if not children or [name for name, _ in children] != [str(i) for i in range(len(children))]:
        return False
    return all(child is not None and any(True for _ in platform.named_parameters(child, recurse=True))
               for _, child in children)


def list_experts(block: Any) -> Optional[Any]:
    """The block's child ``experts`` when it is a per-expert module list, else None."""
    for name, child in get_platform().named_children(block):
        if name == "experts" and is_expert_list(child):
            return child
    return None


def check_list_layout(block: Any, experts: Any) -> int:
    """The number of experts; a ValueError for experts of different structure or a block whose
    routing this forward does not reproduce."""
    platform = get_platform()
    children = [child for _, child in platform.named_children(experts)]
    first = [(n, tuple(p.shape)) for n, p in platform.named_parameters(children[0], recurse=True)]
    for index, child in enumerate(children[1:], 1):
        if [(n, tuple(p.shape)) for n, p in platform.named_parameters(child, recurse=True)] != first:
            raise ValueError(f"ExpertParallel: {type(block).__name__}.experts.{index} differs from experts.0 "
                             f"in its parameter names or shapes; every expert of a list must be alike")
    for name in _NOISE:
        if float(getattr(block, name, 0.0) or 0.0) != 0.0:
            raise ValueError(f"ExpertParallel: {type(block).__name__}.{name}={getattr(block, name)} (random "
                             f"router noise) is not supported with per-expert lists; set it to 0")
    return len(children)


def keep_local(experts: Any, rank: int, ep: int) -> List[Any]:
    """Drop every expert but this rank's E/ep (replaced by empty containers); the local ones."""
    platform = get_platform()
    children = [child for _, child in platform.named_children(experts)]
    per = len(children) // ep
    for index in range(len(children)):
        if not rank * per <= index < (rank + 1) * per:
            experts[index] = type(experts)()     # parameter-free placeholder, keeps global indices
    return children[rank * per:(rank + 1) * per]


def list_compute(local: List[Any], rows: Any, expert_rows: Tuple[int, ...], ep: int, average: bool) -> Any:
    """Local expert j on its ``expert_rows[j]`` rows (every local expert runs, on zero rows if none
    came). With ``average`` the experts' parameter gradients are scaled by 1/ep and the rows' are
    not: the rows' gradient is scaled by ep before the expert and by 1/ep after it."""
    outputs, start = [], 0
    scale = average and ep > 1
    for module, count in zip(local, expert_rows):
        piece = rows[start:start + count]
        start += count
        if scale:
            piece = GradScale(piece, float(ep))
        out = module(piece)
        outputs.append(GradScale(out, 1.0 / ep) if scale else out)
    return get_platform().cat(outputs, 0)


def router_of(block: Any) -> Any:
    """The block's ``gate`` (else ``router``) child, or None."""
    gate = getattr(block, "gate", None)
    return gate if gate is not None else getattr(block, "router", None)


def block_top_k(block: Any) -> int:
    for owner in (block, router_of(block)):
        for name in _TOP_K:
            value = getattr(owner, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return 0


def route(block: Any, hidden: Any, route_fn: Optional[Callable]) -> Tuple[Any, Any, Any]:
    """(top_k_index, top_k_weights, router_logits or None) of ``hidden`` (tokens, H)."""
    if route_fn is not None:
        out = route_fn(block, hidden)
        return out[0], out[1], (out[2] if len(out) > 2 else None)
    router = router_of(block)
    if router is None:
        raise ValueError(f"ExpertParallel: {type(block).__name__} has no 'gate' or 'router' child; pass "
                         f"ExpertParallel(route=fn) with fn(block, hidden) -> (top_k_index, top_k_weights)")
    out = router(hidden)
    if isinstance(out, (tuple, list)):
        return _from_tuple(block, out) + (None,)
    top_k = block_top_k(block)
    probs = out.float().softmax(-1)
    weights, index = probs.topk(top_k, dim=-1)
    if getattr(block, "norm_topk_prob", True):
        weights = weights / weights.sum(-1).reshape(tuple(weights.shape[:-1]) + (1,))
    return index, weights.to(hidden.dtype), out


def _from_tuple(block: Any, out: Any) -> Tuple[Any, Any]:
    platform = get_platform()
    tensors = [t for t in out if t is not None and platform.is_tensor(t)]
    index = next((t for t in tensors if not platform.is_floating_point(t)), None)
    if index is None:
        raise ValueError(f"ExpertParallel: {type(block).__name__}'s router returned no integer expert "
                         f"indices; pass ExpertParallel(route=fn)")
    weights = next((t for t in tensors
                    if platform.is_floating_point(t) and tuple(t.shape) == tuple(index.shape)), None)
    rest = [t for t in tensors if t is not index and t is not weights]
    if weights is None or rest:
        raise ValueError(f"ExpertParallel: {type(block).__name__}'s router returned {len(tensors)} tensors; "
                         f"expected the expert indices and their weights only (an auxiliary loss computed on "
                         f"this rank's tokens alone is not the global one: set its coefficient to 0, e.g. "
                         f"aux_loss_alpha=0, or pass ExpertParallel(route=fn))")
    return index, weights


def shared_output(block: Any, hidden: Any) -> Optional[Any]:
    """The shared experts' output on ``hidden`` (tokens, H), gated where the block gates it."""
    for name in _SHARED:
        shared = getattr(block, name, None)
        if shared is not None:
            out = shared(hidden)
            gate = getattr(block, "shared_expert_gate", None)
            return gate(hidden).sigmoid() * out if gate is not None else out
    return None
