"""fully_shard on MindSpore Cells (core/fully_shard/tuple_grads.py) on 2 MindSpore ranks: ZeRO-3 and
HSDP trained with nn.TrainOneStepCell equal one process, TP × ZeRO-3 on 4 ranks too (losses, this rank's rows of the weights and
of Adam's moments), and the parts MindSpore refuses by name (tests/cases/ms_fully_shard.py)."""
import pytest

from tests.cases import ms_fully_shard
from tests.harness.frameworks import run_on

pytestmark = pytest.mark.mindspore


@pytest.mark.parametrize("shape", [None, (2, 1)], ids=["zero3", "hsdp"])
def test_mindspore_fully_shard_trains_like_one_process(shape):
    assert run_on("mindspore", 2, ms_fully_shard.train_matches_one_process, shape) == [True, True]


def test_mindspore_fully_shard_reduce_dtype():
    # gradients reduced in float16 (fp32 parameters and compute)
    assert run_on("mindspore", 2, ms_fully_shard.train_matches_one_process, mp={"reduce_dtype": "float16"},
                  tol=2e-3) == [True, True]


def test_mindspore_fully_shard_refusals():
    assert run_on("mindspore", 2, ms_fully_shard.unsupported_parts) == [True, True]


def test_mindspore_tp_times_fully_shard_four_ranks():
    assert run_on("mindspore", 4, ms_fully_shard.tp_matches_one_process) == [True] * 4
