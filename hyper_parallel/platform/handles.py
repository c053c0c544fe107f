"""Handles of asynchronous collectives (``async_op=True``)."""
from typing import Any


class AsyncHandle:
    """Result of an ``async_op=True`` collective: ``wait()`` returns the output tensor(s)."""

    def __init__(self, works: Any, finish: Any) -> None:
        self._works = list(works)
        self._finish = finish
        self._result = None
        self._done = False

    def wait(self) -> Any:
        if not self._done:
            for work in self._works:
                work.wait()
            self._result = self._finish()
            self._done = True
        return self._result


class CompletedHandle(AsyncHandle):
    """An async handle for work that already finished (emulated collectives run eagerly)."""

    def __init__(self, result: Any) -> None:
        super().__init__((), lambda: result)
