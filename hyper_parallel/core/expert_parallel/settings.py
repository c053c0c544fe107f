"""The routing settings every ep rank must share (SPEC §19): read from an MoE block and its router,
compared through ``core.agreement.check_agreement`` at ``apply`` and at each call whose settings
changed (a rank that alone changes ``norm_topk_prob`` or ``top_k`` after wrapping raises too).
Routing runs on each rank's own tokens, so a disagreement would not hang: it would silently train
a different model on each rank."""
from typing import Any, Dict, Optional

# attributes of an MoE block or its router that change which experts a token reaches or its weight
ROUTING_ATTRS = ("top_k", "num_experts", "n_routed_experts", "num_experts_per_tok", "num_experts_per_token",
                 "norm_topk_prob", "routed_scaling_factor", "n_group", "topk_group", "capacity_factor",
                 "jitter_noise", "router_jitter_noise", "scoring_func", "topk_method", "aux_loss_alpha",
                 "seq_aux", "router_aux_loss_coef")


def _scalar(value: Any) -> bool:
    return isinstance(value, (bool, int, float, str))


def routing_settings(block: Optional[Any]) -> Dict[str, Any]:
    """{'block.top_k': 2, 'gate.norm_topk_prob': True, ...}: the scalar routing attributes of
    ``block`` and of its ``gate`` / ``router`` child (empty for None)."""
    found: Dict[str, Any] = {}
    if block is None:
        return found
    for prefix, owner in (("block", block), ("gate", getattr(block, "gate", None)),
                          ("router", getattr(block, "router", None))):
        if owner is None:
            continue
        for name in ROUTING_ATTRS:
            value = getattr(owner, name, None)
            if _scalar(value):
                found[f"{prefix}.{name}"] = value
    return found
