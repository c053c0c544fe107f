"""DTensor on MindSpore (real multi-process MindSpore on CPU): from_local / to_local /
redistribute / full_tensor for every pair of placements (1-D and 2x2 meshes, even and uneven
shapes), distribute_tensor, and the sharding-rule dispatch of MindSpore operators (elementwise,
matmul / bmm / linear, reshape / transpose, softmax, reductions, cat / split / indexing, dropout,
SDPA, the replicated fallback), forward and gradients vs single-process MindSpore.
Cases: tests/mindspore/cases_dtensor.py."""
import pytest

from tests.mindspore import cases_dtensor as cases
from tests.mindspore.harness import require_mindspore, run_ms


@pytest.fixture(autouse=True)
def _needs_mindspore():
    require_mindspore()


@pytest.mark.parametrize("world_size", [2, 4])
def test_conversions_every_placement_pair(world_size):
    counts = run_ms(world_size, cases.conversions, timeout=900)
    assert counts[0] == counts[-1] and counts[0] >= 32


def test_distribute_tensor():
    assert run_ms(2, cases.distribute) == [True, True]


@pytest.mark.parametrize("world_size", [2, 4])
def test_op_dispatch_forward_and_gradients(world_size):
    counts = run_ms(world_size, cases.ops_dispatch, timeout=900)
    assert counts[0] == counts[-1] and counts[0] >= 80


def test_fallback_strict_mode_and_unsupported_operations():
    assert run_ms(2, cases.fallback_and_strict) == [True, True]
