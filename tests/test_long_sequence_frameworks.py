"""tiled_mlp and offload_activations through the platform contract: the same check on torch and MindSpore."""
import pytest

from tests.cases import long_sequence_tools
from tests.harness.frameworks import FRAMEWORKS, run_on


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_tiled_mlp_and_offload_on_each_framework(framework):
    offloaded = run_on(framework, 2, long_sequence_tools.tiled_and_offloaded_match_plain)
    assert offloaded[0] == offloaded[1] > 0
