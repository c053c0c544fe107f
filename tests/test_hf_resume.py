"""examples/train_llama_hf.py --save / --resume: a tiny HF Llama trains 2 steps on cp2 x tp2 (4 ranks),
saves model and AdamW state with torch.distributed.checkpoint, resumes on tp4 (another layout: the
saved shards are re-cut on load) for 2 more steps, and those losses must equal steps 3-4 of one
process training the same 4 steps straight through (1e-5, fp32). A resume that dropped the
optimizer state (a fresh AdamW at step 3) misses step 4 by ~1e-3, so the comparison can fail.
"""
import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("transformers")

ROOT = pathlib.Path(__file__).resolve().parents[1]
SIZE = ["--seq", "16", "--hidden", "32", "--vocab", "64", "--steps", "2"]


def _example():
    spec = importlib.util.spec_from_file_location("train_llama_hf", ROOT / "examples" / "train_llama_hf.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(flags):
    launcher = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in launcher}
    env["HP_STRICT_DISPATCH"] = "1"  # no op of a step may take the replicated fallback (issue 15)
    cmd = [sys.executable, str(ROOT / "examples" / "train_llama_hf.py"), *SIZE, *flags]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_resume_on_another_layout_continues_the_single_process_run(tmp_path):
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "resumed.json")
    _run(["--cp", "2", "--tp", "2", "--save", ckpt])
    stdout = _run(["--cp", "1", "--tp", "4", "--resume", ckpt, "--json", out, "--check"])
    assert "[3/4] loss" in stdout and "[4/4] loss" in stdout, stdout
    with open(out) as f:
        resumed = json.load(f)
    assert resumed["first_step"] == 3
    example = _example()
    straight = example.parse_args(["--cp", "1", *SIZE[:-1], "4"])
    reference = sys.modules["_common"].train_single(straight, example)
    assert len(resumed["losses"]) == 2
    for step, (got, want) in enumerate(zip(resumed["losses"], reference[2:]), start=3):
        assert abs(got - want) <= 1e-5, (step, got, want)
    # a flag that fixes the model, data or optimizer must match the checkpoint's: a ValueError
    # naming the flag and the value to pass (before any collective: no ranks needed here)
    wrong = example.parse_args(["--cp", "1", "--tp", "4", *SIZE, "--lr", "0.01", "--resume", ckpt])
    with pytest.raises(ValueError, match="--lr 0.001"):
        sys.modules["_common"].steps_saved(wrong)
    with pytest.raises(ValueError, match="written by --save"):
        sys.modules["_common"].steps_saved(example.parse_args(["--resume", str(tmp_path)]))
