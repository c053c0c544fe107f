"""``python -m benchmarks.moe`` end to end on 2 ranks (opt-in, -m ep_full): its JSON reports expert
bytes per rank equal to total / ep, the dispatch bytes equal to the closed form from the routing
counts (10 all-to-alls a step for 2 MoE layers), and torchtitan's dispatcher either ran (same
gradients as ours) or the reason it did not. Asserts values, never times."""
import json
import subprocess
import sys

import pytest


@pytest.mark.ep_full
def test_moe_benchmark_json(tmp_path):
    import os
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = tmp_path / "moe.json"
    args = ["--nproc", "2", "--rounds", "1", "--tokens", "32", "--hidden", "16", "--inter", "16",
            "--experts", "4"]
    done = subprocess.run([sys.executable, "-m", "benchmarks.moe", *args, "--json", str(path)],
                          cwd=root, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(path.read_text())
    for rank in report["ranks"]:
        assert rank["expert_bytes"] * 2 == rank["expert_bytes_total"]
        assert rank["dispatch_bytes_step"] == rank["closed_form_bytes"]
        assert rank["dispatch_all_to_alls"] == 10
        assert min(rank["imbalance_per_layer"]) >= 1.0
    titan = report["ranks"][0]["torchtitan"]
    assert titan["status"] == "skipped" and titan["reason"] or titan["max_grad_difference"] < 1e-5
