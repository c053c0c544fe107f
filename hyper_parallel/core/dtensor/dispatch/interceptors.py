"""The dispatcher's one extension point: interceptors.

A feature built on DTensor sometimes has to follow particular DTensors through the user's code and
take over the op that finally consumes them. Ring attention is the case: q, k and v travel through
the user's transposes and views to ``F.scaled_dot_product_attention``, where the ring kernel must
run instead of the attention rule's all-gather of K/V. An interceptor is pushed for the duration of
such a call (``intercepting``) and consulted for every dispatched op whose inputs it follows:

* the op is in ``pass_through`` (a pure relayout): it runs as usual and ``passed`` follows its outputs;
* the op is in ``consumers``: ``strategy(call)`` replaces the rule's strategy (None: the rule's);
* any other op reaching a followed tensor raises ``refusal(name)``, since the interceptor could
  not honour what that op would compute.

The dispatcher knows nothing else about the features that use it.
"""
from typing import Any, Iterator
import contextlib
import contextvars

from hyper_parallel.core.bounded_cache import IdentityTable

_stack: contextvars.ContextVar[tuple[Any, ...]] = contextvars.ContextVar("hp_dispatch_interceptors",
                                                                         default=())


class Interceptor:
    pass_through: frozenset[Any] = frozenset()
    consumers: frozenset[Any] = frozenset()

    def __init__(self) -> None:
        self._followed = IdentityTable()   # tensor -> True while it lives

    def follow(self, tensor: Any) -> None:
        self._followed[tensor] = True

    def follows(self, tensor: Any) -> bool:
        return tensor in self._followed

    def passed(self, call: Any, inputs: Any, outputs: Any) -> None:
        """A pass-through op ran on followed ``inputs`` (the call's leaves): follow its DTensor
        ``outputs``. Subclasses may carry per-tensor facts along (attention_roles.SeqTracking)."""
        for out in outputs:
            self.follow(out)

    def strategy(self, call: Any) -> Any:
        """The strategy for a consumer op, or None to let the op's rule decide."""
        return None

    def refusal(self, name: str) -> Any:
        return ValueError(f"{type(self).__name__}: the tensors it follows reach {name!r}, which it cannot "
                          f"take over")


@contextlib.contextmanager
def intercepting(interceptor: Any) -> Iterator[Any]:
    token = _stack.set(_stack.get() + (interceptor,))
    try:
        yield interceptor
    finally:
        _stack.reset(token)


def involved(leaves: Any) -> Any:
    """The innermost active interceptor that follows one of ``leaves``, or None."""
    for interceptor in reversed(_stack.get()):
        if any(interceptor.follows(x) for x in leaves):
            return interceptor
    return None


def screen(name: str, leaves: Any) -> Any:
    """The interceptor an op on ``leaves`` involves, after refusing ops it cannot pass or consume."""
    interceptor = involved(leaves) if _stack.get() else None
    if interceptor is not None and name not in interceptor.pass_through and name not in interceptor.consumers:
        raise interceptor.refusal(name)
    return interceptor


__all__ = ["Interceptor", "intercepting", "involved", "screen"]
