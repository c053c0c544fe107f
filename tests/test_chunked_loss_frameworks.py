"""chunked_cross_entropy written once in core: the same closed-form check on torch and MindSpore."""
import pytest

from tests.cases import chunked_loss
from tests.harness.frameworks import FRAMEWORKS, run_on


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_chunked_cross_entropy_on_each_framework(framework):
    assert run_on(framework, 2, chunked_loss.matches_closed_form) == [9, 9]
