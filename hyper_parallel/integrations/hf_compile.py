"""parallelize_model(compile=True): each decoder layer compiled after it was parallelized
(docs/compile.md), as torchtitan compiles its blocks: the layer's forward, with its TP / CP
collectives, becomes one compiled graph; fully_shard's and data_parallel's hooks stay outside."""
from hyper_parallel.integrations.hf_fully_shard import decoder_layers
from hyper_parallel.platform import get_platform


def compile_decoder_layers(model, compile_option):
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
    for layer in decoder_layers(model):
        platform.compile_module(layer, **kwargs)
    return model
