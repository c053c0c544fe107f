"""Which attention kernels ContextParallel can distribute, and a clear error for the others.

The module's forward sees q, k, v as DTensors; the supported kernels are those whose call core
dispatches with a rule: ``F.scaled_dot_product_attention`` (every mode, masks included), the NPU
``npu_fusion_attention``, and attention written with matmul / softmax (not in ring mode, not with
``attention_masks``). FlexAttention is not among them: it compiles its higher-order op with
TorchDynamo, which cannot trace tensor subclasses such as DTensor, so it fails deep inside dynamo
(e.g. "Dynamo does not know how to trace method `new_empty` of class `DTensor`"). Such failures
are turned into a ValueError naming the supported kernels; the original error is chained.
"""
from typing import Any

SUPPORTED = ("F.scaled_dot_product_attention (every mode, attention_masks for padding / packed "
             "documents), hyper_parallel.attention (the same, with soft-capping, sinks and a sliding "
             "window), the NPU npu_fusion_attention, or attention written with matmul/softmax "
             "(all-gather / Ulysses modes without attention_masks)")
_UNSUPPORTED = ("flex_attention",)


def _frames(exc):
    tb = exc.__traceback__
    while tb is not None:
        yield tb.tb_frame.f_code.co_filename, tb.tb_frame.f_code.co_name
        tb = tb.tb_next


def unsupported_kernel(exc: Any) -> Any:
    """The name of the unsupported attention kernel ``exc`` came from, or None."""
    text = str(exc)
    for name in _UNSUPPORTED:
        if any(name in filename or name == function for filename, function in _frames(exc)):
            return name
        if type(exc).__module__.startswith("torch._dynamo") and name in text:
            return name   # a torch.compile'd flex_attention fails with the user frame in the message
    return None


def call_module(original: Any, args: Any, kwargs: Any) -> Any:
    """``original(*args, **kwargs)``; a failure inside an unsupported kernel becomes a ValueError."""
    try:
        return original(*args, **kwargs)
    except Exception as exc:   # noqa: BLE001 (re-raised unless it is an unsupported kernel)
        name = unsupported_kernel(exc)
        if name is None:
            raise
        raise ValueError(f"ContextParallel: the attention module calls {name}, which cannot run on "
                         f"DTensors (TorchDynamo cannot trace them: {type(exc).__name__}). Supported "
                         f"kernels: {SUPPORTED}. For torchtitan, use its SDPA attention "
                         f"(attn_type / use_flex_attn off).") from exc


__all__ = ["SUPPORTED", "call_module", "unsupported_kernel"]
