"""The MindSpore operator sweep (tests/cases/ms_op_sweep.py) and MindSpore's loss paths: DTensor
results equal single-process MindSpore or raise, on 1-D and 2x2 meshes; a scalar DTensor loss
returned to ms.grad / value_and_grad gives single-process gradients; loss_parallel() raises on
MindSpore instead of silently doing nothing."""
import pytest

from tests.cases import ms_op_sweep, ms_losses
from tests.harness.frameworks import run_on

pytestmark = pytest.mark.mindspore


@pytest.mark.parametrize("world_size,mesh_shape", [(2, (2,)), (4, (2, 2))], ids=["1d-2", "2d-2x2"])
def test_mindspore_op_sweep(world_size, mesh_shape):
    results = run_on("mindspore", world_size, ms_op_sweep.sweep, list(mesh_shape), timeout=600)
    rows, failures = results[0]
    print(f"\nMindSpore op sweep on mesh {mesh_shape} (world {world_size}):")
    print(ms_op_sweep.table({mesh_shape: rows}))
    assert len(rows) >= 50, len(rows)
    assert not failures, "\n".join(failures)
    assert all(r == results[0] for r in results), "ranks disagree"


@pytest.mark.parametrize("world_size", [2, 4])
def test_mindspore_dtensor_loss_gradients(world_size):
    assert run_on("mindspore", world_size, ms_losses.dtensor_loss_gradients, timeout=300) == [True] * world_size
