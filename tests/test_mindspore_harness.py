"""The MindSpore worker harness (tests/mindspore/harness.py): results, failures, no orphans."""
import os
import time

import pytest

from tests.mindspore import cases_smoke
from tests.mindspore.harness import (MsDistFailure, kill_ms_pool, ms_pool_pids, require_mindspore,
                                     run_ms)


pytestmark = pytest.mark.mindspore


@pytest.fixture(autouse=True)
def _needs_mindspore():
    require_mindspore()


def _alive(pid):
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    try:  # a zombie is not alive
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


def test_results_seeds_and_reuse():
    first = run_ms(2, cases_smoke.environment)
    assert [r["platform"] for r in first] == ["mindspore", "mindspore"]
    assert all(int(r["numpy"].split(".")[0]) < 2 for r in first)
    assert first[0]["random"] == first[1]["random"]          # every case starts from the same seed
    assert first[0]["ms_random"] == first[1]["ms_random"]
    again = run_ms(2, cases_smoke.environment)
    assert [r["pid"] for r in again] == [r["pid"] for r in first]   # the pool is reused
    assert again[0]["random"] == first[0]["random"]
    gathered = run_ms(2, cases_smoke.hello)
    assert [g["gathered"] for g in gathered] == [[0.0, 1.0], [0.0, 1.0]]


def test_failing_rank_traceback_then_fresh_pool():
    run_ms(2, cases_smoke.hello)
    before = ms_pool_pids(2)
    with pytest.raises(MsDistFailure) as info:
        run_ms(2, cases_smoke.raise_on, 1, timeout=60)
    text = str(info.value)
    assert "failing rank(s): [1]" in text and "--- rank 1: raised" in text
    assert "ValueError: deliberate failure on rank 1" in text and "--- rank 0: ok" in text
    time.sleep(0.5)
    assert not any(_alive(pid) for pid in before), "the failed pool's processes must be gone"
    assert run_ms(2, cases_smoke.raise_on, -1) == [0, 1]      # a fresh pool works


def test_timeout_reports_stacks_and_death_reports_exit_code():
    with pytest.raises(MsDistFailure) as info:
        run_ms(2, cases_smoke.sleep_on, 0, 120, timeout=8)
    text = str(info.value)
    assert "--- rank 0: timed out: no answer within 8 s; killed" in text
    assert "sleep_on" in text                                 # where it was stuck
    with pytest.raises(MsDistFailure) as info:
        run_ms(2, cases_smoke.exit_on, 1, 3, timeout=60)
    assert "--- rank 1: died (exit code 3)" in str(info.value)


def test_kill_leaves_no_orphans():
    run_ms(2, cases_smoke.hello)
    pids = ms_pool_pids(2)
    assert len(pids) == 3                                      # scheduler + 2 workers
    kill_ms_pool(2)
    time.sleep(0.5)
    assert not any(_alive(pid) for pid in pids)


def test_rejects_lambdas():
    with pytest.raises(TypeError):
        run_ms(2, lambda rank, world_size: rank)
