"""The expert layouts ExpertParallel splits, and the local grouped compute on one rank's experts.

Stacked (Hugging Face 5.x, Qwen3-MoE / Mixtral / DeepSeek-V3 / Qwen3-Next / Kimi-Linear / gpt-oss):
``gate_up_proj`` (E, 2I, H) and ``down_proj`` (E, H, I) — or transposed, (E, H, 2I) / (E, I, H),
with ``is_transposed`` (gpt-oss) — optional ``gate_up_proj_bias`` / ``down_proj_bias`` (E, ...), and
the module's own ``_apply_gate`` (SwiGLU halves, gpt-oss's clamped interleave) or ``act_fn``.
Every parameter whose dim 0 is E is split on that dim.
"""
from typing import Any, Dict, Tuple

from hyper_parallel.platform import get_platform

STACKED = ("gate_up_proj", "down_proj")
BIASES = ("gate_up_proj_bias", "down_proj_bias")


def is_stacked_experts(module: Any) -> bool:
    """A module holding every expert as stacked 3-D ``gate_up_proj`` / ``down_proj`` parameters."""
    params = dict(get_platform().named_parameters(module))
    return all(name in params and len(params[name].shape) == 3 for name in STACKED)


def find_experts(module: Any) -> Tuple[Any, str]:
    """(the stacked experts module, its path relative to ``module``): ``module`` itself or a
    child named ``experts`` (an MoE block)."""
    if is_stacked_experts(module):
        return module, ""
    for name, child in get_platform().named_children(module):
        if name == "experts" and is_stacked_experts(child):
            return child, name
    raise ValueError(f"ExpertParallel: {type(module).__name__} holds no stacked experts (3-D 'gate_up_proj' "
                     f"and 'down_proj' parameters, itself or in a child named 'experts'); apply it to the "
                     f"experts module of a Hugging Face 5.x MoE layer")


def expert_parameter_names(module: Any) -> Tuple[str, ...]:
    """The parameters split on the expert dim: the stacked weights and their biases."""
    params = dict(get_platform().named_parameters(module))
    return tuple(name for name in STACKED + BIASES if name in params)


def check_layout(module: Any) -> int:
    """The number of experts; a ValueError for a layout the local compute does not reproduce."""
    params = dict(get_platform().named_parameters(module))
    num = int(params["gate_up_proj"].shape[0])
    for name in expert_parameter_names(module):
        if int(params[name].shape[0]) != num:
            raise ValueError(f"ExpertParallel: {type(module).__name__}.{name} has {params[name].shape[0]} "
                             f"rows on dim 0, gate_up_proj {num}: every expert tensor must lead with E")
    for flag, bad in (("has_post_expert_norm", True), ("has_gate", False)):
        if getattr(module, flag, not bad) == bad:
            raise ValueError(f"ExpertParallel: {type(module).__name__} sets {flag}={bad}; that expert "
                             f"variant is not supported (stacked gate/up + down projections only)")
    if not hasattr(module, "_apply_gate") and not hasattr(module, "act_fn"):
        raise ValueError(f"ExpertParallel: {type(module).__name__} has neither _apply_gate nor act_fn")
    return num


def _gate(module: Any, gate_up: Any) -> Any:
    if hasattr(module, "_apply_gate"):
        return module._apply_gate(gate_up)
    half = int(gate_up.shape[-1]) // 2
    return module.act_fn(gate_up[..., :half]) * gate_up[..., half:]


def _project(rows: Any, weight: Any, transposed: bool) -> Any:
    # a Linear's layout (out, in) unless the module stores (in, out)
    return rows @ (weight if transposed else weight.swapaxes(0, 1))


def grouped_compute(module: Any, local: Dict[str, Any], rows: Any,
                    expert_rows: Tuple[int, ...]) -> Any:
    """Run local expert j on its ``expert_rows[j]`` consecutive rows of ``rows``. Every local expert
    runs, on zero rows if none came, so each expert weight has a gradient every step."""
    transposed = bool(getattr(module, "is_transposed", False))
    outputs, start = [], 0
    for j, count in enumerate(expert_rows):
        piece = rows[start:start + count]
        start += count
        gate_up = _project(piece, local["gate_up_proj"][j], transposed)
        if "gate_up_proj_bias" in local:
            gate_up = gate_up + local["gate_up_proj_bias"][j]
        out = _project(_gate(module, gate_up), local["down_proj"][j], transposed)
        if "down_proj_bias" in local:
            out = out + local["down_proj_bias"][j]
        outputs.append(out)
    return get_platform().cat(outputs, 0)
