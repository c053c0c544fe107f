# tests/test_doc_example_frameworks.py
import pytest
from tests.cases import doc_example
from tests.harness.frameworks import framework_worlds, run_on


@pytest.mark.parametrize("framework,world_size", framework_worlds(2, 4))
def test_gather_rows(framework, world_size):
    assert run_on(framework, world_size, doc_example.gather_rows, 3) == [3 * world_size] * world_size
