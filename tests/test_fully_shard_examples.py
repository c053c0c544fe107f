"""The torch examples with ``--dp-shard N`` (fully_shard instead of data_parallel) at tiny sizes:
each spawns its own ranks and exits 0 only if every step's loss equals one process to 1e-5 (--check),
with no op taking the replicated fallback (HP_STRICT_DISPATCH=1). The examples' loss is normalised by
the global token count, so these also test parallelize_model(..., average=False)."""
import importlib.util
import os
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("transformers")

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY = ["--steps", "2", "--seq", "16", "--vocab", "64", "--check"]


def _run(example, *args, timeout=420):
    launcher = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in launcher}
    env["HP_STRICT_DISPATCH"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    return subprocess.run([sys.executable, str(ROOT / "examples" / example), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def _assert_checked(done, last="[2/2] loss"):
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert last in done.stdout and "max |loss - single-process loss|" in done.stdout, out


def test_hf_example_dp_shard_check_save_and_resume_on_tp(tmp_path):
    """ZeRO-3 over the flattened dp_shard × cp ranks, saved (DCP of the sharded model and AdamW
    state); resumed as ZeRO-3 × TP on (dp_shard, tp): two more steps equal one process training all
    four straight through."""
    directory = str(tmp_path / "ckpt")
    _assert_checked(_run("train_llama_hf.py", "--dp-shard", "2", "--cp", "2", "--mode", "allgather-lb",
                         "--hidden", "32", *TINY, "--save", directory))
    done = _run("train_llama_hf.py", "--dp-shard", "2", "--cp", "1", "--tp", "2", "--hidden", "32", *TINY,
                "--resume", directory)
    _assert_checked(done, last="[4/4] loss")
    assert "[3/4] loss" in done.stdout, done.stdout


def test_hf_example_hsdp_check():
    _assert_checked(_run("train_llama_hf.py", "--dp", "2", "--dp-shard", "2", "--cp", "1", "--hidden", "32",
                         *TINY))


@pytest.mark.skipif(importlib.util.find_spec("torchtitan") is None, reason="torchtitan is not installed")
def test_titan_example_dp_shard_check():
    # TP+SP × fully_shard on (dp_shard, tp): the TP shards of every block's weights are dp-sharded too
    _assert_checked(_run("train_llama_titan.py", "--dp-shard", "2", "--cp", "1", "--tp", "2", "--dim", "32",
                         *TINY))


def test_example_refuses_hsdp_with_cp():
    """--dp × --dp-shard with --cp would need HSDP over a flattened mesh fully_shard does not take:
    refused before any rank starts, naming the flags and the fix."""
    done = _run("train_llama_hf.py", "--dp", "2", "--dp-shard", "2", "--cp", "2", timeout=120)
    assert done.returncode != 0 and "HSDP (--dp × --dp-shard) with context parallelism" in done.stderr, \
        done.stderr


def _average_errors(rank, world_size):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from hyper_parallel import init_device_mesh
    from hyper_parallel.integrations.transformers import parallelize_model
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                                         num_attention_heads=2, vocab_size=32))
    messages = []
    for shape, names, average in (((1,), ("tp",), False), ((1,), ("dp_shard",), "no")):
        try:
            parallelize_model(model, init_device_mesh("cpu", shape, mesh_dim_names=names), average=average)
        except ValueError as exc:
            messages.append(str(exc))
    return messages


def test_parallelize_model_average_errors():
    """average=False without a dp_shard dim would silently do nothing (data_parallel owns that
    reduction), and a non-bool average is refused: both ValueErrors name the value and the fix."""
    from tests.harness import run_dist
    no_dim, not_bool = run_dist(1, _average_errors)[0]
    assert "average=False" in no_dim and "data_parallel(model, mesh, average=False)" in no_dim
    assert "average='no'" in not_bool and "True or False" in not_bool
