"""CommDebugMode: count the collectives (and bytes sent by this rank) while it is active.

Bytes are what one rank sends with a bandwidth-optimal algorithm: all-gather (n-1)·local,
all-to-all and reduce-scatter (n-1)/n·input, all-reduce 2(n-1)/n·input, point-to-point the
tensors sent, broadcast the tensor (source only).
"""
from typing import Any
from collections import Counter

from hyper_parallel.platform import get_platform


class CommDebugMode:
    def __init__(self) -> None:
        self.counts: Any = Counter()
        self.bytes: Any = Counter()
        self.log: list[Any] = []

    def _observe(self, op, nbytes, ranks):
        self.counts[op] += 1
        self.bytes[op] += nbytes
        self.log.append((op, nbytes, tuple(ranks)))

    def __enter__(self):
        self.counts.clear()
        self.bytes.clear()
        self.log.clear()
        get_platform().add_comm_observer(self._observe)
        return self

    def __exit__(self, *exc):
        get_platform().remove_comm_observer(self._observe)
        return False

    def get_total_counts(self) -> Any:
        return sum(self.counts.values())

    def get_comm_counts(self) -> Any:
        return dict(self.counts)

    def get_total_bytes(self) -> Any:
        return sum(self.bytes.values())

    def get_comm_bytes(self) -> Any:
        return dict(self.bytes)

    def summary(self) -> Any:
        lines = [f"{op:16s} x{self.counts[op]:<4d} {self.bytes[op]:>14,d} B" for op in sorted(self.counts)]
        return "\n".join(lines) or "no collectives"
