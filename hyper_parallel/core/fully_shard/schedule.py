"""The order units run in, shared by every unit under one root: it decides what to prefetch.

Forward prefetch follows the order of the previous forward (the first step: module registration
order, which is the call order of a transformer's blocks); backward prefetch follows the reverse of
this step's post-forward order, which is the order backward reaches the units. Every rank runs
the same model, so every rank prefetches the same units in the same order and the collectives of
the shared group stay matched.
"""
from typing import Any


class Schedule:
    def __init__(self, states: Any) -> None:
        self.states = states                 # every unit under the root, root first
        self.forward_order = list(states)    # until a forward has been seen
        self._pre: list[Any] = []
        self._post: list[Any] = []
        self.backward_order: list[Any] = []
        self.pending_final = False           # the end-of-backward callback is queued
        self._calls: dict[Any, Any] = {}    # unit -> forward calls since the root's forward began

    def begin_forward(self) -> None:
        self._pre, self._post = [], []
        self._calls = {}

    def calls_of(self, state: Any) -> Any:
        """How many times ``state`` started its forward since the root's last began (this call too)."""
        return self._calls.get(state, 0)

    def record_pre_forward(self, state: Any) -> None:
        self._pre.append(state)
        self._calls[state] = self._calls.get(state, 0) + 1

    def record_post_forward(self, state: Any) -> None:
        self._post.append(state)
        self.backward_order = list(reversed(self._post))

    def end_forward(self) -> None:
        if self._pre:
            self.forward_order = list(self._pre)

    @staticmethod
    def _after(order, state):
        for i, s in enumerate(order):
            if s is state:
                return order[i + 1] if i + 1 < len(order) else None
        return None

    def next_forward(self, state: Any) -> Any:
        return self._after(self.forward_order, state)

    def next_backward(self, state: Any) -> Any:
        return self._after(self.backward_order, state)
