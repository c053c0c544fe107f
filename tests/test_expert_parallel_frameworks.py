"""The expert-parallel dispatch on each framework (tests/cases/expert_parallel.py): MindSpore runs the
same core code through its emulated list all-to-all (docs/mindspore.md's capability table)."""
import pytest

from tests.cases import expert_parallel
from tests.harness.frameworks import FRAMEWORKS, run_on


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_dispatch_on_each_framework(framework):
    assert run_on(framework, 2, expert_parallel.dispatch_matches_dense) == [True, True]


@pytest.mark.mindspore
def test_expert_parallel_on_a_mindspore_cell():
    """ExpertParallel on a MindSpore Cell with stacked experts, 2 CPU ranks, against one process."""
    from tests.cases import ms_expert_parallel
    assert run_on("mindspore", 2, ms_expert_parallel.cell_matches_dense) == [True, True]
