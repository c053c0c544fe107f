"""Process groups and small helpers shared by MindSpore's native collectives and emulations.

A "group" here is a :class:`MsGroup`: the MindSpore group name plus the ranks in the order the
group was created with. "Group rank i" is always the i-th rank of that order (a mesh coordinate),
whatever order MindSpore numbers the group in.
"""
from typing import Any
import os

import numpy as np

from hyper_parallel.platform.base import REDUCE_OPS
from hyper_parallel.platform.handles import AsyncHandle, CompletedHandle


def check_reduce_op(op: Any) -> None:
    if op not in REDUCE_OPS:
        raise ValueError(f"reduce op {op!r} is not supported; use one of {list(REDUCE_OPS)}")


def nbytes(tensor: Any) -> Any:
    return int(np.prod(tensor.shape, dtype=np.int64)) * tensor.itemsize


def numel(tensor: Any) -> int:
    return int(np.prod(tensor.shape, dtype=np.int64))


def force_emulation() -> bool:
    """``HP_MS_EMULATE_COLLECTIVES=1``: the emulations even where native collectives exist."""
    return os.environ.get("HP_MS_EMULATE_COLLECTIVES", "").strip().lower() in ("1", "true", "yes", "on")


def handle(works: Any, finish: Any, async_op: Any) -> Any:
    """Either the finished result, or an AsyncHandle whose wait() waits for ``works``."""
    result = AsyncHandle([w for w in works if w is not None], finish)
    return result if async_op else result.wait()


def then(result: Any, finish: Any, async_op: Any) -> Any:
    """``finish`` applied to a collective's result (or, async, to what its handle returns)."""
    if async_op:
        return AsyncHandle([result], lambda: finish(result.wait()))
    return finish(result)


def done(result: Any, async_op: Any) -> Any:
    return CompletedHandle(result) if async_op else result


class MsGroup:
    """A process group: MindSpore's group name and the ranks in creation order."""

    __slots__ = ("name", "ranks", "_native_order")

    def __init__(self, name: str, ranks: Any) -> None:
        self.name = name
        self.ranks = tuple(ranks)
        ascending = sorted(self.ranks)
        # data that MindSpore returns in ascending-rank order, re-indexed to creation order
        self._native_order = None if list(self.ranks) == ascending else \
            [ascending.index(r) for r in self.ranks]

    def __len__(self):
        return len(self.ranks)

    def __repr__(self):
        return f"MsGroup({self.name!r}, ranks={self.ranks})"

    def to_creation_order(self, pieces: Any) -> Any:
        return pieces if self._native_order is None else [pieces[i] for i in self._native_order]

    def to_native_order(self, pieces: Any) -> Any:
        if self._native_order is None:
            return pieces
        out = [None] * len(pieces)
        for mine, native in enumerate(self._native_order):
            out[native] = pieces[mine]
        return out
