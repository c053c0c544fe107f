"""MindSpore training against one process (cases in tests/mindspore/cases_training.py): DTensor
factories, data_parallel's gradient reducer in nn.TrainOneStepCell (DP on 2 ranks, DP x TP on 4:
losses per step, reduced gradients, parameters after Adam steps), checkpoints with layouts (saved
sharded on 2 ranks; loaded on 2 and 4 ranks with other layouts, into a plain Cell, in a single
process without a launcher; a single-process MindSpore checkpoint into a parallelized Cell), and
resuming training from a DP2 x TP2 checkpoint (parameters and Adam's state) on TP4 and in one
process, and the GRAPH_MODE errors."""
import os
import subprocess

import pytest

from tests.mindspore import cases_training as cases
from tests.mindspore.harness import REPO, mindspore_python, require_mindspore, run_ms

pytestmark = pytest.mark.mindspore


@pytest.fixture(autouse=True)
def _needs_mindspore():
    require_mindspore()


def test_factories():
    assert run_ms(2, cases.factories) == [True, True]


def test_data_parallel_train_step_two_ranks():
    losses = run_ms(2, cases.data_parallel_train, 1)
    assert losses[0] != losses[1]        # each rank trained on its own half of the batch


def test_data_parallel_times_tensor_parallel_four_ranks():
    losses = run_ms(4, cases.data_parallel_train, 2)
    # TP ranks of one DP group see the same batch slice, the two DP groups different ones
    assert losses[0] == losses[1] and losses[2] == losses[3] and losses[0] != losses[2]


def test_data_parallel_over_flattened_dp_cp_mesh():
    losses = run_ms(4, cases.data_parallel_train, 1, flatten=True)
    assert len({tuple(v) for v in losses}) == 4     # four different batch slices


def test_data_parallel_no_sync_sum_and_errors():
    assert run_ms(2, cases.data_parallel_details) == [True, True]


def test_graph_mode_errors(tmp_path):
    assert run_ms(2, cases.graph_mode_errors, str(tmp_path / "g")) == [True, True]


def test_checkpoint_save_sharded_load_anywhere(tmp_path):
    directory = str(tmp_path / "ckpt")
    assert run_ms(2, cases.checkpoint_save, directory) == [True, True]
    assert sorted(os.listdir(directory)) == ["rank0.ckpt", "rank0.layout.json", "rank1.ckpt",
                                             "rank1.layout.json"]
    assert run_ms(2, cases.checkpoint_load_layouts, directory) == [True, True]
    assert run_ms(4, cases.checkpoint_load_layouts, directory) == [True] * 4
    # one process, no launcher
    code = ("from tests.mindspore.cases_training import single_process_load; "
            f"print(single_process_load({directory!r}))")
    env = dict(os.environ, HP_PLATFORM="mindspore", PYTHONPATH=REPO)
    for key in ("MS_ROLE", "MS_WORKER_NUM", "MS_SCHED_HOST", "MS_SCHED_PORT", "MS_NODE_ID"):
        env.pop(key, None)
    done = subprocess.run([mindspore_python(), "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("True"), \
        done.stdout[-2000:] + done.stderr[-3000:]


def test_checkpoint_resume_training_on_another_layout(tmp_path):
    directory = str(tmp_path / "resume")
    assert run_ms(4, cases.checkpoint_resume, directory) == [True] * 4
    # a 2-rank save into the directory of a 4-rank save: the stale rank2/rank3 files go
    assert run_ms(2, cases.checkpoint_save, directory) == [True, True]
    assert sorted(os.listdir(directory)) == ["rank0.ckpt", "rank0.layout.json", "rank1.ckpt",
                                             "rank1.layout.json"]
