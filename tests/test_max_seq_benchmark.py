"""python -m benchmarks.max_seq at tiny sizes on 2 local ranks: it runs, every row finds a length, the
JSON has the goal rows. No memory or timing assertions (they would flake); the numbers are reported."""
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("transformers")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.timeout(900)      # two spawned ranks importing transformers: minutes on a loaded machine
def test_max_seq_benchmark_runs_tiny(tmp_path):
    out = tmp_path / "max_seq.json"
    cmd = [sys.executable, "-m", "benchmarks.max_seq", "--nproc", "2", "--budget", str(48 * 2**20),
           "--granularity", "128", "--start", "256", "--max-seq", "256", "--chunk-size", "128",
           "--configs", "plain HF (1 rank),cp + all three", "--goal-tokens", "512", "--goal-vocab", "1024",
           "--goal-hidden", "32", "--goal-intermediate", "96", "--goal-chunk", "128", "--json", str(out)]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                             "MASTER_PORT")}
    proc = subprocess.run(cmd, cwd=ROOT, env=dict(env, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                          timeout=850)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    payload = json.loads(out.read_text())
    assert [r["config"] for r in payload["rows"]] == ["plain HF (1 rank)", "cp + all three"]
    for row in payload["rows"]:
        assert row["max_seq"] % 128 == 0 and row["trials"] >= 1, row
    assert [g["name"] for g in payload["goals"]] == ["loss", "mlp"]
    assert all(g["plain_bytes"] > 0 and g["tiled_bytes"] > 0 for g in payload["goals"])
    assert "max seq" in proc.stdout and "ratio" in proc.stdout
