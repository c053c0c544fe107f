"""examples/train_llama_titan.py: torchtitan's Llama 3 model code under TP+SP × CP × DP on local CPU
ranks, every step's loss equal to the same training in one process (the example's --check), with no
op taking the replicated fallback (HP_STRICT_DISPATCH=1 turns one into an error; issue 15).
Skips when torchtitan (the `titan` extra) is not installed."""
import importlib.util
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "train_llama_titan.py"
TINY = ["--steps", "2", "--seq", "16", "--dim", "32", "--vocab", "64"]

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("torchtitan") is None,
    reason="torchtitan is not installed (pip install -e '.[titan]')")


def _run(*args, timeout=420):
    # no launcher variables: the example spawns its own ranks; the repo root on the path so the
    # ranks import this checkout whether or not it is pip-installed; every op of the training step
    # (forward and backward) must have a sharding rule: a fallback raises on the rank
    launcher = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in launcher}
    env["HP_STRICT_DISPATCH"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    return subprocess.run([sys.executable, str(EXAMPLE), *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_titan_example_matches_one_process():
    # one 4-rank run (each rank imports torchtitan: ~10 s of CPU): TP+SP with GQA (one k/v head per
    # TP rank) under zigzag ring CP; DP is the same data_parallel the HF example's test covers
    done = _run("--cp", "2", "--tp", "2", "--mode", "ring-zigzag", "--kv-heads", "2", *TINY, "--check")
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert "[2/2] loss" in done.stdout and "max |loss - single-process loss|" in done.stdout, out


def test_titan_example_rejects_unsplittable_sizes():
    done = _run("--cp", "2", "--tp", "3", *TINY)
    assert done.returncode != 0
    assert "ValueError" in done.stderr and "--tp 3 must divide --heads 4" in done.stderr, done.stderr


def test_titan_example_rejects_attention_it_cannot_split():
    """Only torchtitan's SDPA inner attention is split (its default FlexAttention takes a block
    mask ContextParallel does not shard): anything else is a ValueError naming the layer, raised
    before the mesh is touched."""
    import importlib.util as iu
    import torch
    spec = iu.spec_from_file_location("train_llama_titan", EXAMPLE)
    example = iu.module_from_spec(spec)
    spec.loader.exec_module(example)
    model = example.build_model(example.parse_args(TINY))
    model.layers["1"].attention.inner_attention = torch.nn.Identity()
    with pytest.raises(ValueError, match=r"layers\.1\.attention\.inner_attention is Identity"):
        example.parallelize(model, None, "ulysses")
