"""ContextParallel on MindSpore Cells (real multi-process MindSpore on CPU): Ulysses, all-gather
KV, hybrid (world 4) and head-tail load balance, BSHD and BNSD, attention written with
hyper_parallel's MindSpore SDPA and with plain matmul/softmax, causal and not; forward and dq/dk/dv
equal single-process MindSpore attention on the full sequence. Cases: tests/mindspore/cases_cp.py."""
import pytest

from tests.mindspore import cases_cp as cases
from tests.mindspore.harness import require_mindspore, run_ms

GRID = [(2, "ulysses"), (2, "allgather"), (2, "load_balance"),
        (4, "ulysses"), (4, "allgather"), (4, "load_balance"), (4, "hybrid")]


@pytest.fixture(autouse=True)
def _needs_mindspore():
    require_mindspore()


@pytest.mark.parametrize("world_size,mode", GRID)
def test_context_parallel_matches_single_process(world_size, mode):
    done = run_ms(world_size, cases.cp_grid, mode, timeout=600)
    expected = 4 if mode == "load_balance" else 8    # layouts x kinds (x causal)
    assert [len(d) for d in done] == [expected] * world_size


@pytest.mark.parametrize("world_size", [2, 4])
def test_masks_dtensor_io_and_errors(world_size):
    done = run_ms(world_size, cases.cp_extras, timeout=600)
    assert all(len(d) == 2 for d in done)
