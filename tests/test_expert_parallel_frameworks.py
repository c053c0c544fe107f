"""The expert-parallel dispatch on each framework (tests/cases/expert_parallel.py): MindSpore runs the
same core code through its emulated list all-to-all (docs/mindspore.md's capability table)."""
import pytest

from tests.cases import expert_parallel
from tests.harness.frameworks import FRAMEWORKS, run_on


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_dispatch_on_each_framework(framework):
    assert run_on(framework, 2, expert_parallel.dispatch_matches_dense) == [True, True]
