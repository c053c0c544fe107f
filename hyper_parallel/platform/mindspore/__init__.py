"""The MindSpore platform (see platform.py). ``scaled_dot_product_attention`` is PyTorch's SDPA for
MindSpore tensors and DTensors (MindSpore has none on CPU)."""


def __getattr__(name):
    if name == "scaled_dot_product_attention":
        from hyper_parallel.platform.mindspore.attention import scaled_dot_product_attention
        return scaled_dot_product_attention
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
