"""loss_parallel(): cross-entropy on vocabulary-sharded logits without gathering them."""
from typing import Iterator
import contextlib

from hyper_parallel.core.dtensor.ops import loss as _loss_rules

__all__ = ["loss_parallel"]


@contextlib.contextmanager
def loss_parallel() -> Iterator[None]:
    """Inside this context, ``F.cross_entropy`` on a DTensor whose class dim is sharded (the
    ``Shard(-1)`` logits of a ColwiseParallel output head with ``use_local_output=False``)
    computes the loss, and in backward its gradient, on the local vocabulary shards: a max, a
    sum of exponentials and the target logit are each all-reduced (a few numbers per token),
    never the logits. The loss is a replicated DTensor; ``loss.backward()`` works inside or
    outside the context. Supported: class-index or probability targets, ``reduction``
    mean/sum/none, ``ignore_index``, ``label_smoothing``. With ``weight=`` the class dim is
    gathered first (correct, not communication-free). Labels outside ``[0, C)`` other than
    ``ignore_index`` raise ``IndexError`` on every rank (one host read of a flag per call).
    On MindSpore entering the context raises ``NotImplementedError`` (see the message).

    Example::

        with loss_parallel():
            loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(0, 1))
            loss.backward()
    """
    from hyper_parallel.platform import get_platform
    reason = get_platform().loss_parallel_unsupported()
    if reason:  # a context that changed nothing would let users believe the logits stay sharded
        raise NotImplementedError(f"loss_parallel() is not available here: {reason}")
    _loss_rules.enter_loss_parallel()
    try:
        yield
    finally:
        _loss_rules.exit_loss_parallel()
