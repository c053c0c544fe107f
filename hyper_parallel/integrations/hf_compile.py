"""parallelize_model(compile=True): each decoder layer compiled after it was parallelized
(docs/compile.md), as torchtitan compiles its blocks: the layer's forward, with its TP / CP
collectives, becomes one compiled graph; fully_shard's and data_parallel's hooks stay outside."""
from typing import Any
import warnings

from hyper_parallel.integrations.hf_fully_shard import decoder_layers
from hyper_parallel.platform import get_platform


def compile_decoder_layers(model: Any, compile_option: Any) -> Any:
    """``compile_option``: True (torch.compile's defaults) or a dict of ``torch.compile`` keyword
    arguments (``{"backend": "aot_eager"}``, ``{"mode": "max-autotune"}``...)."""
    if compile_option is True:
        kwargs = {}
    elif isinstance(compile_option, dict):
        kwargs = dict(compile_option)
    else:
        raise ValueError(f"parallelize_model(compile={compile_option!r}): pass True, False or a dict of "
                         f"torch.compile keyword arguments such as {{'backend': 'aot_eager'}}")
    platform = get_platform()
    split = []
    for index, layer in enumerate(decoder_layers(model)):
        if not any(_expert_parallel(m) for m in layer.modules()):
            platform.compile_module(layer, **kwargs)
            continue
        # expert dispatch reads its routing counts on the host (its all-to-all splits): it cannot be
        # traced, so the layer is compiled around it: each child holding no expert-parallel module
        # and modules of its own (the attention) is one graph; the MoE block and the norms run eagerly
        split.append(index)
        for child in layer.children():
            if any(True for _ in child.children()) and not any(_expert_parallel(m) for m in child.modules()):
                platform.compile_module(child, **kwargs)
    if split:
        warnings.warn(f"parallelize_model(compile=...): decoder layers {split} hold expert-parallel MoE "
                      f"layers: their attention is compiled, the MoE dispatch runs eagerly (it reads routing "
                      f"counts on the host); docs/compile.md")
    return model


def _expert_parallel(module: Any) -> bool:
    return getattr(module, "_hp_expert_parallel", None) is not None
