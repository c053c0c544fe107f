"""The overhead benchmarks end to end at tiny sizes (2 spawned ranks), JSON checked; no timing
assertions: ``benchmarks.dtensor_dispatch`` (per-op dispatch and a TP block step against PyTorch
DTensor) and ``benchmarks.cp_overhead`` (ContextParallel against its raw-collective form)."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(tmp_path, module, *args):
    out = tmp_path / f"{module}.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)  # no launcher: the benchmark spawns its own ranks
    cmd = [sys.executable, "-m", f"benchmarks.{module}", "--nproc", "2", *args, "--json", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


def test_dtensor_dispatch_benchmark(tmp_path):
    data, stdout = _run(tmp_path, "dtensor_dispatch", "--rounds", "1", "--calls", "2", "--dim", "16",
                        "--seq", "4")
    assert "chain, inputs requiring grad" in data["ops"] and "hp / torch" in stdout
    for row in list(data["ops"].values()) + [data["tp_block"]]:
        assert all(row[k] > 0 for k in ("hyper_parallel", "torch DTensor")), row


def test_cp_overhead_benchmark(tmp_path):
    data, stdout = _run(tmp_path, "cp_overhead", "--seq", "32", "--heads", "2", "--head-dim", "4",
                        "--rounds", "1")
    assert set(data["result"]) == {"framework", "raw"} and "ratio" in stdout
    assert all(v > 0 for row in data["result"].values() for v in row.values()), data


def test_cp_overhead_rejects_bad_arguments():
    proc = subprocess.run([sys.executable, "-m", "benchmarks.cp_overhead", "--seq", "30", "--nproc", "4"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--seq 30 is not divisible by --nproc 4" in proc.stderr, proc.stderr
