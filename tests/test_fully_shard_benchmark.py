"""benchmarks/fully_shard.py end to end at tiny sizes on 2 ranks: bytes sent per step equal the
closed form and each rank holds total / N (JSON checked; no timing assertions)."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_benchmark_counts_match_the_closed_form(tmp_path):
    out = tmp_path / "fs.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)  # no launcher: the benchmark spawns its own ranks
    cmd = [sys.executable, "-m", "benchmarks.fully_shard", "--nproc", "2", "--layers", "2", "--hidden", "16",
           "--rounds", "1", "--json", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    payload = json.loads(out.read_text())
    for r in payload["ranks"]:
        assert r["bytes_sent_step"] == r["closed_form_bytes"], r
        assert r["comm"] == {"all_gather": 5, "reduce_scatter": 3}, r["comm"]
        whole = r["held"]["hyper_parallel.data_parallel"]["total"]
        held = r["held"]["hyper_parallel.fully_shard"]
        # parameters, gradients and moments halve; AdamW's scalar step counters stay whole
        assert held["params"] + held["grads"] <= whole / 2 and held["total"] <= 1.05 * whole / 2, r["held"]
    assert "hyper_parallel.fully_shard" in payload["step_ms"]
