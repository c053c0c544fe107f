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
    skipped = []
    for index, layer in enumerate(decoder_layers(model)):
        if any(getattr(m, "_hp_expert_parallel", None) is not None for m in layer.modules()):
            # expert dispatch reads its routing counts on the host: it cannot be traced
            skipped.append(index)
            continue
        platform.compile_module(layer, **kwargs)
    if skipped:
        warnings.warn(f"parallelize_model(compile=...): decoder layers {skipped} hold expert-parallel MoE "
                      f"layers and stay eager (their dispatch reads routing counts on the host); "
                      f"docs/compile.md")
    return model
