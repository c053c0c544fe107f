"""What a user sees of the library's communication: the accounting of every collective (observers:
``CommDebugMode``, the benchmarks) and profiler ranges around collectives and the context-parallel
and fully_shard phases, so a framework profiler's trace names them (moved out of base.py, which
inherits it; torch's ranges: platform/torch/profiling.py).
"""
from typing import Any, Callable, ContextManager, List
import contextlib
import threading

CommObserver = Callable[[str, int, tuple], None]

# one shared no-op context (nullcontext is reentrant and reusable): the hot path allocates nothing
_NO_RANGE = contextlib.nullcontext()


class ObservabilityContract:
    """Declared members of communication accounting and profiler ranges."""

    _comm_observers: List[CommObserver]
    _observer_lock: threading.Lock

    def add_comm_observer(self, observer: CommObserver) -> None:
        """``observer(op_name, bytes_sent, group_ranks)`` is called for every collective."""
        with self._observer_lock:
            self._comm_observers.append(observer)

    def remove_comm_observer(self, observer: CommObserver) -> None:
        """Stop calling ``observer``."""
        with self._observer_lock:
            self._comm_observers.remove(observer)

    def record_comm(self, op_name: str, bytes_sent: int, group_ranks: tuple) -> None:
        """Report one collective to the observers (the collectives call this)."""
        for observer in list(self._comm_observers):
            observer(op_name, bytes_sent, group_ranks)

    def profile_range(self, name: str) -> ContextManager[Any]:
        """Context manager: a range called ``name`` in the framework profiler's trace while one
        records (names: ``hyper_parallel::<collective>``, ``hyper_parallel::context_parallel::*``,
        ``hyper_parallel::fully_shard::*``). Cheap when none records. Frameworks without a
        profiler range API: a context that does nothing."""
        return _NO_RANGE
