"""Multi-process test harness: persistent gloo worker pools, one per world size.

    from tests.harness import run_dist, DistTestFailure
    results = run_dist(world_size, fn, *args, timeout=120, **kwargs)

See docs/testing.md.
"""
from tests.harness.pool import (DistTestFailure, kill_pool, pool_pids, run_dist,
                                shutdown_pools)

__all__ = ["run_dist", "DistTestFailure", "pool_pids", "kill_pool", "shutdown_pools"]
