"""examples/train_cell_mindspore.py: a MindSpore transformer Cell under TP (hyper_parallel's styles) x
DP (data_parallel's gradient reducer in nn.TrainOneStepCell) on local CPU ranks, every step's loss
equal to the same training in one process (the example's --check). Runs the example with the
MindSpore interpreter (tests/mindspore/harness.py finds it); skips without one unless
HP_REQUIRE_MINDSPORE=1."""
import os
import pathlib
import subprocess

import pytest

from tests.mindspore.harness import mindspore_python, require_mindspore

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "train_cell_mindspore.py"
TINY = ["--steps", "2", "--layers", "1", "--seq", "8", "--dim", "16", "--heads", "2", "--vocab", "32"]

pytestmark = pytest.mark.mindspore


# --dp-shard 2: fully_shard on each block and the root instead of data_parallel (2 ranks: the
# cheapest; TP × fully_shard on MindSpore is tests/test_fully_shard_mindspore.py's)
@pytest.mark.parametrize("layout", [["--dp", "2", "--tp", "1"], ["--dp", "1", "--tp", "2"],
                                    ["--dp", "1", "--dp-shard", "2", "--tp", "1"]])
def test_mindspore_example_matches_one_process(layout):
    require_mindspore()
    launcher = ("MS_ROLE", "MS_NODE_ID", "MS_WORKER_NUM", "MS_SCHED_HOST", "MS_SCHED_PORT", "RANK_TABLE_FILE")
    env = {k: v for k, v in os.environ.items() if k not in launcher}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    done = subprocess.run([mindspore_python(), str(EXAMPLE), *layout, *TINY, "--check"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    out = done.stdout + done.stderr[-4000:]
    assert done.returncode == 0, out
    assert "[2/2] loss" in done.stdout and "max |loss - single-process loss|" in done.stdout, out
