"""One live worker pool per world size, shared by the torch and MindSpore harnesses.

A pool is any object with ``start()``, ``run(payload, timeout, label)``, ``stop()``, ``kill()``,
``healthy()``, ``pids()`` and ``closed``. A pool that failed or was interrupted mid-case is never
reused: it is killed and the next call starts a fresh one.
"""
import threading


class PoolRegistry:
    def __init__(self, make_pool):
        self._make_pool = make_pool
        self._lock = threading.RLock()
        self._pools = {}

    def run(self, world_size, payload, timeout, label):
        with self._lock:
            pool = self._pools.get(world_size)
            if pool is not None and not pool.healthy():
                pool.kill()
                pool = None
            if pool is None:
                pool = self._make_pool(world_size)
                self._pools[world_size] = pool
                try:
                    pool.start()
                except BaseException:
                    pool.kill()
                    self._pools.pop(world_size, None)
                    raise
            try:
                return pool.run(payload, timeout, label)
            except BaseException:
                # a failure has already killed the pool; an interruption (Ctrl-C, pytest-timeout)
                # leaves it mid-case, so it cannot be reused either
                pool.kill()
                if self._pools.get(world_size) is pool:
                    del self._pools[world_size]
                raise

    def pids(self, world_size):
        """Process ids of the live pool for ``world_size`` (empty if there is none)."""
        with self._lock:
            pool = self._pools.get(world_size)
            return pool.pids() if pool is not None and not pool.closed else []

    def kill(self, world_size):
        """Kill the pool for ``world_size`` now (the next run starts a fresh one)."""
        with self._lock:
            pool = self._pools.pop(world_size, None)
            if pool is not None:
                pool.kill()

    def shutdown(self):
        """Stop every pool gracefully, killing what does not stop."""
        with self._lock:
            pools = list(self._pools.values())
            self._pools.clear()
        for pool in pools:
            try:
                pool.stop()
            except BaseException:
                pool.kill()
