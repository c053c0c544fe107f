"""The model's own state kept across the setup probes of ``parallelize_model``.

The probes (context parallelism's sequence audit, ``verify=True``, the chunked loss's logits probe)
run the model on made-up sequences. A module with state that depends on what it saw would keep the
probes' trace: Hugging Face's dynamic / longrope rotary embedding re-registers ``inv_freq`` and
raises ``max_seq_len_cached`` to the probe's length and keeps it, so training on shorter sequences
then computes with another frequency table than one process does. ``kept_state`` restores every
module's buffers (the objects and their values) and plain attributes afterwards.
"""
import contextlib
from typing import Any, Iterator

_PLAIN = (bool, int, float, str, type(None))


@contextlib.contextmanager
def kept_state(model: Any) -> Iterator[None]:
    """Run the block, then put back each module's buffers and plain (non-underscore) attributes as
    they were before it; attributes and buffers the block added are left alone."""
    import torch

    saved = []
    for module in model.modules():
        attrs = {k: v for k, v in vars(module).items() if not k.startswith("_") and isinstance(v, _PLAIN)}
        buffers = {k: (t, None if t is None or t.is_meta else t.detach().clone())
                   for k, t in module._buffers.items()}
        saved.append((module, attrs, buffers))
    try:
        yield
    finally:
        with torch.no_grad():
            for module, attrs, buffers in saved:
                for name, value in attrs.items():
                    setattr(module, name, value)
                for name, (tensor, values) in buffers.items():
                    module._buffers[name] = tensor
                    if values is not None and tensor is not None:
                        tensor.copy_(values)
