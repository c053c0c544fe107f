"""The multi-process harness itself: results, failures, deaths, timeouts, cleanup."""
import os
import time

import pytest

from tests.harness import DistTestFailure, pool_pids, run_dist


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie still answers kill(0); it is dead for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _wait_all_dead(pids, within=10.0):
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if not any(_alive(p) for p in pids):
            return True
        time.sleep(0.1)
    return False


# ------------------------------------------------------------------ case functions (module level)
def _identity_case(rank, world_size, offset, scale=1):
    import torch
    from hyper_parallel.platform import get_platform
    platform = get_platform()
    assert platform.get_rank() == rank and platform.get_world_size() == world_size
    assert os.environ["OMP_NUM_THREADS"] == "1" and torch.get_num_threads() == 1
    total = platform.all_reduce(torch.tensor([float(rank)]), None)
    return {"rank": rank, "value": (rank + offset) * scale, "sum": float(total.item()),
            "pid": os.getpid(), "draw": torch.rand(3).tolist()}


def _raise_on_rank1(rank, world_size):
    if rank == 1:
        raise ValueError("boom from rank one: marker-7f3a")
    return rank


def _die_in_all_reduce(rank, world_size):
    import torch
    from hyper_parallel.platform import get_platform
    if rank == 1:
        time.sleep(0.5)
        os._exit(1)
    get_platform().all_reduce(torch.ones(4), None)  # rank 0 waits here for rank 1 forever
    return rank


def _sleep_on_rank1(rank, world_size, seconds):
    if rank == 1:
        time.sleep(seconds)
    return rank


# ------------------------------------------------------------------ tests
def test_results_per_rank_and_seeded():
    results = run_dist(2, _identity_case, 10, scale=2)
    assert [r["rank"] for r in results] == [0, 1]
    assert [r["value"] for r in results] == [20, 22]
    assert all(r["sum"] == 1.0 for r in results)
    # Every case starts from torch.manual_seed(1234) on every rank.
    again = run_dist(2, _identity_case, 0)
    assert results[0]["draw"] == results[1]["draw"] == again[0]["draw"]
    # The pool is persistent: the same processes served both cases.
    assert [r["pid"] for r in results] == [r["pid"] for r in again] == pool_pids(2)


def test_rank_exception_carries_traceback():
    before = pool_pids(2)
    with pytest.raises(DistTestFailure) as info:
        run_dist(2, _raise_on_rank1, timeout=30)
    text = str(info.value)
    assert isinstance(info.value, AssertionError)
    assert "rank 1: raised" in text and "failing rank(s): [1]" in text
    assert "ValueError: boom from rank one: marker-7f3a" in text
    assert "_raise_on_rank1" in text and "Traceback (most recent call last)" in text
    assert "rank 0: ok" in text
    assert _wait_all_dead(before)
    assert run_dist(2, _identity_case, 0)[1]["value"] == 1  # a fresh pool serves the next case


def test_dead_rank_fails_within_timeout_and_leaves_nothing():
    run_dist(2, _identity_case, 0)
    old = pool_pids(2)
    assert len(old) == 2 and all(_alive(p) for p in old)
    start = time.monotonic()
    with pytest.raises(DistTestFailure) as info:
        run_dist(2, _die_in_all_reduce, timeout=20)
    assert time.monotonic() - start < 20
    text = str(info.value)
    assert "rank 1: died (exit code 1)" in text
    assert "failing rank(s)" in text and "1" in text
    assert _wait_all_dead(old), f"worker processes left behind: {[p for p in old if _alive(p)]}"
    assert pool_pids(2) == []
    assert run_dist(2, _identity_case, 0)[0]["sum"] == 1.0


def test_timeout_fails_and_next_case_works():
    run_dist(2, _identity_case, 0)
    old = pool_pids(2)
    start = time.monotonic()
    with pytest.raises(DistTestFailure) as info:
        run_dist(2, _sleep_on_rank1, 60, timeout=3)
    assert time.monotonic() - start < 15
    text = str(info.value)
    assert "rank 1: timed out" in text and "rank 0: ok" in text
    assert "_sleep_on_rank1" in text  # the stuck rank's stack is in the report
    assert _wait_all_dead(old)
    assert run_dist(2, _sleep_on_rank1, 0) == [0, 1]


def test_local_function_is_rejected():
    def local(rank, world_size):
        return rank
    with pytest.raises(TypeError, match="module-level"):
        run_dist(2, local)
