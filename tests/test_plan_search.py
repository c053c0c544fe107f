"""The planner's command line and search on a tiny Llama config.json (dry runs in this process): the
SPEC §16 JSON fields, the ranking, 'does not fit', the layer scaling against a whole-model dry run,
and the clear error on MindSpore."""
import contextlib
import io
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("transformers")

CONFIG = dict(model_type="llama", hidden_size=64, intermediate_size=160, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, vocab_size=512, head_dim=16,
              max_position_embeddings=1024)
CANDIDATE_KEYS = {"mesh", "cp_mode", "features", "peak_memory_bytes", "fits", "step_seconds",
                  "tokens_per_second_per_device", "mfu"}


def _cli(*argv):
    from hyper_parallel.plan.cli import main
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in argv])
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def config_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("plan") / "config.json"
    path.write_text(json.dumps(CONFIG))
    return str(path)


def test_search_json_ranks_the_candidates(config_path):
    code, out, err = _cli("search", "--model", config_path, "--seq", 256, "--gpus", 4, "--device", "h100",
                          "--cp-modes", "zigzag", "--json")
    assert code == 0, err
    result = json.loads(out)
    assert set(result) == {"model", "seq", "gpus", "device", "best", "candidates"}
    assert (result["seq"], result["gpus"], result["device"]) == (256, 4, "h100")
    candidates = result["candidates"]
    assert all(set(c) == CANDIDATE_KEYS for c in candidates)
    meshes = {(c["mesh"]["dp_shard"], c["mesh"]["cp"], c["mesh"]["tp"], c["cp_mode"]) for c in candidates}
    # every dp_shard x cp x tp of 4 ranks (zigzag where cp > 1); tp=4 is refused (2 K/V heads)
    assert meshes == {(4, 1, 1, None), (2, 1, 2, None), (2, 2, 1, "zigzag"), (1, 4, 1, "zigzag"),
                      (1, 2, 2, "zigzag")}
    assert all(c["fits"] for c in candidates) and candidates[0] == result["best"]
    rates = [c["tokens_per_second_per_device"] for c in candidates]
    assert rates == sorted(rates, reverse=True) and all(c["step_seconds"] > 0 for c in candidates)
    assert "#" in err and "refused {'dp_shard': 1, 'cp': 1, 'tp': 4}" in err   # progress bar, refusal


@pytest.mark.plan_full
def test_search_nothing_fits(config_path):
    code, out, err = _cli("search", "--model", config_path, "--seq", 256, "--gpus", 1, "--device", "a100",
                          "--memory-gib", 0.0001, "--json")
    result = json.loads(out)
    assert result["best"] is None and result["candidates"]
    assert not any(c["fits"] for c in result["candidates"])
    # the feature ladder was climbed to its last rung before giving up
    assert all(c["features"] == ["chunked_loss", "checkpoint", "tiled_mlp"] for c in result["candidates"])
    code, out, err = _cli("search", "--model", config_path, "--seq", 256, "--gpus", 1, "--device", "a100",
                          "--memory-gib", 0.0001)
    assert "nothing fits" in out


def _dry_run_args(path):
    return ["dry-run", "--model", path, "--seq", 256, "--mesh", "dp_shard=2,cp=2", "--cp-mode", "zigzag",
            "--rank", 3, "--json", "--device", "h100"]


def test_dry_run_json(config_path):
    code, out, err = _cli(*_dry_run_args(config_path))
    assert code == 0, err
    report = json.loads(out)
    assert set(report["memory_bytes"]) == {"parameters", "gradients", "optimizer_state", "activations",
                                           "communication_buffers", "temporaries"}
    assert sum(report["memory_bytes"].values()) == report["peak_memory_bytes"] > 0
    assert set(report["comm"]) == {"cp", "dp_shard+cp"} and report["flops"] > 0
    # the ring's hops and fully_shard's collectives, with what each rank sends
    assert report["comm"]["cp"]["collectives"] > 0 and report["comm"]["dp_shard+cp"]["bytes_sent"] > 0
    assert report["prediction"]["fits"] and report["prediction"]["step_seconds"] > 0


@pytest.mark.plan_full
def test_layer_scaling(config_path):
    """A 6-layer model dry-run whole and scaled from 1 and 2 layers: FLOPs and bytes equal exactly."""
    with open(config_path) as f:
        six = dict(json.load(f), num_hidden_layers=6)
    path = os.path.join(os.path.dirname(config_path), "six.json")
    with open(path, "w") as f:
        json.dump(six, f)
    whole = json.loads(_cli(*_dry_run_args(path))[1])
    scaled = json.loads(_cli(*_dry_run_args(path), "--layers", 1)[1])
    assert (scaled["layers_run"], scaled["layers"]) == (1, 6)
    assert scaled["flops"] == whole["flops"] and scaled["comm"] == whole["comm"]
    assert abs(scaled["peak_memory_bytes"] - whole["peak_memory_bytes"]) <= 0.02 * whole["peak_memory_bytes"]


def test_bad_arguments_are_named(config_path):
    code, _, err = _cli("dry-run", "--model", "no-such-model", "--seq", 256, "--mesh", "cp=2")
    assert code == 2 and "no-such-model" in err and "llama3.1-8b" in err
    code, _, err = _cli("dry-run", "--model", config_path, "--seq", 256, "--mesh", "dp_shard=2,xp=2")
    assert code == 2 and "['dp_shard', 'xp']" in err and "dp_replicate" in err
    code, _, err = _cli("dry-run", "--model", config_path, "--seq", 255, "--mesh", "cp=2")
    assert code == 2 and "seq_len 255" in err


def test_builtin_models_build():
    """Every built-in name is a config transformers accepts, with the published sizes."""
    from hyper_parallel.plan.models import BUILTIN, load_config
    sizes = {}
    for name in BUILTIN:
        config, _ = load_config(name)
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        sizes[name] = (text.hidden_size, text.num_hidden_layers)
    assert sizes["llama3.1-8b"] == (4096, 32) and sizes["llama3.1-70b"] == (8192, 80)
    assert sizes["llama3.1-405b"] == (16384, 126) and sizes["deepseek-v3"] == (7168, 61)
    assert sizes["mixtral-8x7b"] == (4096, 32) and sizes["qwen3-30b-a3b"] == (2048, 48)
    assert sizes["qwen3-235b-a22b"] == (4096, 94) and sizes["mixtral-8x22b"] == (6144, 56)
    kimi = load_config("kimi-linear-48b")[0]
    # published full_attn_layers [4, 8, 12, 16, 20, 24, 27] (1-based)
    full = [i + 1 for i, t in enumerate(kimi.layer_types) if t == "full_attention"]
    assert full == [4, 8, 12, 16, 20, 24, 27]
    assert load_config("llama3-8b")[0].to_dict() == load_config("llama3.1-8b")[0].to_dict()


def test_fit_is_the_usable_fraction():
    """'Does not fit' is exactly peak > USABLE_FRACTION x the device's memory (an H100: 81559 MiB)."""
    from hyper_parallel.plan.roofline import DEVICES, USABLE_FRACTION, fits
    h100 = DEVICES["h100"]["memory"]
    assert h100 == 81559 * 2 ** 20 and 0.85 <= USABLE_FRACTION < 1
    assert fits(USABLE_FRACTION * h100, h100) and not fits(USABLE_FRACTION * h100 + 1, h100)
    assert fits(10 ** 15, None)


def test_mindspore_is_refused():
    python = os.environ.get("HP_MINDSPORE_PYTHON", "/work/main/.venv-ms/bin/python")
    if not os.path.exists(python):
        pytest.skip("no MindSpore environment")
    code = ("from hyper_parallel.plan.dry_run import torch_tools\n"
            "try:\n    torch_tools()\nexcept RuntimeError as e:\n    print(e)\n")
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, HP_PLATFORM="mindspore"),
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert "HP_PLATFORM=mindspore has no fake tensors" in out.stdout, out.stderr[-2000:]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
