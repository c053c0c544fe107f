"""Hugging Face's ``mla_kv_a_proj`` TP style (DeepSeek-V2/V3, GLM-4-MoE-Lite, ...): MLA's
``kv_a_proj_with_mqa`` under tensor parallelism.

The projection's output is [latent (kv_lora_rank) | shared rotary key (qk_rope_head_dim)]; its
weight stays whole on every TP rank. The latent reaches ``kv_b_proj`` (colwise), whose input
gradient the TP rule already sums over the ranks. The rotary key goes to every rank's own heads
directly, so each rank holds only its heads' share of that gradient: it is summed over the TP
ranks in backward (forward unchanged), and the projection's weight gradient is then the one of a
single process on every rank.
"""
from typing import Any

from hyper_parallel.core.autograd_functions import lazy_autograd_function
from hyper_parallel.core.tensor_parallel import ParallelStyle
from hyper_parallel.platform import get_platform


def _forward(ctx: Any, tensor: Any, group: Any) -> Any:
    ctx.group = group
    return tensor.view(tuple(tensor.shape))


def _backward(ctx: Any, grad: Any) -> tuple:
    return get_platform().all_reduce(grad.contiguous(), ctx.group, "sum"), None


SumGradOverTP = lazy_autograd_function("MlaRopeGradSum", _forward, _backward)


class MlaKvAProj(ParallelStyle):
    """``kv_a_proj_with_mqa``: replicated weight, the rotary key's gradient summed over TP."""

    def __init__(self, rope_dim: int) -> None:
        self.rope_dim = rope_dim

    def apply(self, module: Any, device_mesh: Any) -> Any:
        platform, rope, group = get_platform(), self.rope_dim, device_mesh.get_group(0)

        def hook(_mod: Any, _args: Any, output: Any) -> Any:
            width = int(output.shape[-1])
            latent, key = output[..., :width - rope], output[..., width - rope:]
            return platform.cat([latent, SumGradOverTP(key, group)], -1)
        platform.register_forward_hook(module, hook)
        return module


def mla_kv_a_proj_style(config: Any) -> Any:
    """A factory for translate_plan; a ValueError when the config lacks the rotary width."""
    rope = getattr(config, "qk_rope_head_dim", None)
    if not isinstance(rope, int) or rope <= 0:
        raise ValueError(f"parallelize_model: the TP plan uses 'mla_kv_a_proj' but the config has no "
                         f"positive qk_rope_head_dim ({rope!r}); pass tp=None")
    return lambda: MlaKvAProj(rope)
