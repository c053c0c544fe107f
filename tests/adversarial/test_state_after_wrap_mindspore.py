"""MindSpore's fully_shard and data_parallel when ranks disagree about the parameters they wrap:
the same ValueError on every rank (tests/cases/ms_state_after_wrap.py)."""
import pytest

from tests.cases import ms_state_after_wrap
from tests.harness.frameworks import run_on

pytestmark = pytest.mark.mindspore


def test_mindspore_ranks_that_disagree_about_parameters():
    assert run_on("mindspore", 2, ms_state_after_wrap.ranks_disagree) == [True, True]
