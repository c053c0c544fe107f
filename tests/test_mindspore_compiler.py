"""MindSpore compiler edges (cases in tests/mindspore/cases_compiler.py): a plain Tensor or Parameter
on the left of + - * / ** % & | ^ with a DTensor on the right equals one process, values and
gradients, residual ``x + sublayer(x)`` included; every jit entry point (ms.jit ast / bytecode /
trace, GRAPH_MODE Cells) given DTensors, parallelized Cells or ContextParallel raises the documented
PYNATIVE_MODE error before compiling, and eager use still works afterwards; ms.vjp of a non-scalar
DTensor output raises a clear ValueError, of its full_tensor() equals one process."""
import pytest

from tests.mindspore import cases_compiler as cases
from tests.mindspore.harness import require_mindspore, run_ms

pytestmark = pytest.mark.mindspore


@pytest.fixture(autouse=True)
def _needs_mindspore():
    require_mindspore()


@pytest.mark.parametrize("world_size", [2, 4])
def test_tensor_on_the_left_of_operators(world_size):
    counts = run_ms(world_size, cases.tensor_left_operators)
    assert counts == [counts[0]] * world_size and counts[0] == 3 * 2 * len(cases.FLOAT_OPS)


def test_tensor_on_the_left_gradients():
    assert run_ms(2, cases.tensor_left_gradients) == [True, True]


def test_residual_with_dtensor_sublayer():
    assert run_ms(2, cases.residual_block) == [True, True]


def test_jit_entry_points_refuse_dtensors():
    names = run_ms(2, cases.jit_entry_points)
    assert names[0] == names[1] and len(names[0]) == 3 * 7 + 4, names[0]


def test_vjp_of_dtensor_outputs():
    assert run_ms(2, cases.vjp_outputs) == [True, True]


def test_scalar_on_the_left_of_operators():
    assert run_ms(2, cases.scalar_left_operators) == [True, True]
