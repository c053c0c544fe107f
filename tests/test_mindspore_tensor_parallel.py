"""Tensor parallelism on MindSpore Cells (real multi-process MindSpore on CPU, world 2): a
ColwiseParallel -> RowwiseParallel MLP of mint.nn.Linear or nn.Dense equals the single-process
MLP in forward (one all-reduce), in the input and parameter gradients, and after an SGD step.
Cases: tests/mindspore/cases_tp.py."""
import pytest

from tests.mindspore import cases_tp as cases
from tests.mindspore.harness import require_mindspore, run_ms


@pytest.fixture(autouse=True)
def _needs_mindspore():
    require_mindspore()


@pytest.mark.parametrize("kind", ["mint", "dense"])
def test_colwise_rowwise_mlp(kind):
    names = run_ms(2, cases.colwise_rowwise, kind, timeout=300)
    assert names[0] == ["w1.bias", "w1.weight", "w2.bias", "w2.weight"]
