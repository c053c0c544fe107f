"""The gated delta rule and its causal convolution under CP, written once (tests/cases/cp_linear_attention.py),
on torch and on MindSpore: each rank's output and gradients equal the single-device rule."""
import pytest

from tests.cases import cp_linear_attention
from tests.harness.frameworks import framework_worlds, run_on


@pytest.mark.parametrize("framework,world_size", framework_worlds(2, mindspore=(2,)))
def test_linear_attention_on_every_framework(framework, world_size):
    assert run_on(framework, world_size, cp_linear_attention.all_cases) == [True] * world_size
