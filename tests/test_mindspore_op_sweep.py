"""The MindSpore operator sweep (tests/cases/ms_op_sweep.py) and MindSpore's loss paths: DTensor
results equal single-process MindSpore or raise, on 1-D and 2x2 meshes; a scalar DTensor loss
returned to ms.grad / value_and_grad gives single-process gradients; loss_parallel() raises on
MindSpore instead of silently doing nothing."""
import pytest

from tests.cases import ms_model_ops, ms_op_sweep, ms_losses
from tests.harness.frameworks import run_on

pytestmark = pytest.mark.mindspore


@pytest.mark.parametrize("world_size,mesh_shape,uneven", [(2, (2,), False), (4, (2, 2), False), (4, (4,), True)],
                         ids=["1d-2", "2d-2x2", "1d-4-uneven"])
def test_mindspore_op_sweep(world_size, mesh_shape, uneven):
    """On the 1-D mesh of 4 every input is sharded on a dim 4 does not divide: uneven pieces, the
    last ones empty (6 -> 2, 2, 2, 0), which MindSpore's kernels mishandle (empty reductions return
    uninitialised memory)."""
    results = run_on("mindspore", world_size, ms_op_sweep.sweep, list(mesh_shape), None, uneven, timeout=600)
    rows, failures = results[0]
    print(f"\nMindSpore op sweep on mesh {mesh_shape} (world {world_size}{', uneven/empty shards' if uneven else ''}):")
    print(ms_op_sweep.table({mesh_shape: rows}))
    assert len(rows) >= (len(ms_op_sweep.UNEVEN_SAMPLE) if uneven else 50), len(rows)
    assert not failures, "\n".join(failures)
    assert all(r == results[0] for r in results), "ranks disagree"


def test_mindspore_core_empty_piece_reductions():
    """Core's rules that reduce a raw local piece themselves (``reductions._mean_local``,
    ``embedding._vocab_parallel_local``) go through ``platform.local_sum``: MindSpore's own sum
    leaves an empty (uneven) piece's output uninitialised, a silent wrong result."""
    results = run_on("mindspore", 4, ms_op_sweep.core_empty_piece_cases, timeout=300)
    assert all(r == results[0] for r in results), "ranks disagree"
    bad = {k: v for k, v in results[0].items() if not (isinstance(v, float) and v < 1e-5)}
    assert not bad, bad


@pytest.mark.parametrize("world_size", [2, 4])
def test_mindspore_dtensor_loss_gradients(world_size):
    assert run_on("mindspore", world_size, ms_losses.dtensor_loss_gradients, timeout=300) == [True] * world_size


@pytest.mark.parametrize("world_size,mesh_shape", [(4, (4,)), (4, (2, 2))], ids=["1d-4-uneven", "2d-2x2"])
def test_mindspore_model_ops_take_rules(world_size, mesh_shape):
    """The primitives mapped to real models' rules (op_names_models.py) equal one process and take
    the rule (5 and 3 over 4 ranks: uneven pieces, empty ones included)."""
    results = run_on("mindspore", world_size, ms_model_ops.check, list(mesh_shape), timeout=600)
    bad = [(rank,) + tuple(r) for rank, rows in enumerate(results) for r in rows
           if r[2] != "rule" or r[3] is not None]
    assert not bad, "\n".join(str(r) for r in bad)
    assert all([r[:3] for r in rows] == [r[:3] for r in results[0]] for rows in results), "ranks disagree"
