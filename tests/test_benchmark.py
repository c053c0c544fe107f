"""The CP benchmark end to end: tiny sizes, 2 local ranks, JSON checked (no timing assertions)."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(tmp_path, *extra):
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "benchmarks.cp_attention", "--nproc", "2", "--batch", "1", "--seq", "64",
           "--heads", "4", "--head-dim", "8", "--iters", "1", "--warmup", "0", "--json", str(out), *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)  # no launcher: the benchmark spawns its own ranks
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


@pytest.mark.parametrize("extra", [(), ("--kv-heads", "2", "--no-causal")], ids=["causal", "gqa-noncausal"])
def test_benchmark_json(tmp_path, extra):
    payload, stdout = _run(tmp_path, *extra)
    rows = {r["mode"]: r for r in payload["rows"]}
    expected = {"reference (1 device)", "ulysses", "allgather", "allgather-lb", "ring", "ring-zigzag",
                "ulysses (raw)", "allgather (raw)", "allgather-lb (raw)"}
    assert expected <= set(rows), sorted(rows)
    assert rows["hybrid"].get("skipped"), "hybrid needs 1 < ulysses_degree < world: skipped on 2 ranks"
    for name in expected - {"reference (1 device)"}:
        row = rows[name]
        assert not row.get("skipped"), row
        assert row["ok"] and max(row["err_out"], row["err_grad"]) <= payload["tolerance"], row
        # counted bytes sent per rank in one forward equal the closed form of SPEC §8
        assert row["bytes_fwd"] == pytest.approx(row["formula_bytes"]), row
        assert row["fwd_ms"] > 0 and row["fwd_bwd_ms"] > 0 and row["peak_mem_bytes"] > 0
    causal = "--no-causal" not in extra
    assert rows["allgather"]["imbalance"] == pytest.approx(2.0 if causal else 1.0)
    assert rows["allgather-lb"]["imbalance"] == pytest.approx(1.0)
    assert "ulysses" in stdout and "formula" in stdout  # the table was printed


def test_benchmark_fails_when_error_exceeds_tolerance(tmp_path):
    """A mode whose result is wrong must make the benchmark exit non-zero, naming the mode."""
    env_patch = tmp_path / "sitecustomize.py"
    env_patch.write_text(
        "import benchmarks.cp_attention as b\n"
        "b.TOLERANCE['float32'] = -1.0\n")
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-c",
           "import sys; sys.path.insert(0, %r); import sitecustomize; import benchmarks.cp_attention as b; "
           "sys.exit(b.main(['--nproc', '2', '--seq', '32', '--heads', '2', '--head-dim', '4', '--iters', '1', "
           "'--warmup', '0', '--modes', 'ulysses', '--json', %r]))" % (str(tmp_path), str(out))]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), ROOT])
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "error above tolerance" in proc.stdout and "in: ulysses" in proc.stdout, proc.stdout[-2000:]
