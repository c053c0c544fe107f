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
                "ulysses (raw)", "allgather (raw)", "allgather-lb (raw)", "ulysses-overlap",
                "allgather-overlap"}
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


def test_benchmark_window_rows_bytes_equal_the_closed_form(tmp_path):
    """--window W: every mode runs the windowed attention exactly, and the bytes each rank sends
    equal the closed form; the contiguous ring's shrink with the window (4 ranks of 16 tokens, a
    window of 8 keys reaches one block back: 1 hop instead of 3)."""
    modes = "ulysses,allgather,allgather-lb,hybrid,ring,ring-zigzag,hybrid-ring"
    payload, _ = _run(tmp_path, "--nproc", "4", "--window", "8", "--modes", modes)
    rows = {r["mode"]: r for r in payload["rows"]}
    assert payload["config"]["window"] == 8
    for name in modes.split(","):
        row = rows[name]
        assert row["ok"] and max(row["err_out"], row["err_grad"]) <= payload["tolerance"], row
        assert row["bytes_fwd"] == pytest.approx(row["formula_bytes"]), row
    hop = 2 * 1 * 16 * 4 * 8 * 4   # K and V of one block: B * L * heads * D fp32 values each
    assert rows["ring"]["bytes_fwd"] == hop


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


@pytest.mark.parametrize("args, needle", [
    (("--nproc", "0"), "--nproc 0"), (("--iters", "0"), "--iters 0"), (("--batch", "0"), "--batch 0"),
    (("--seq", "-8"), "--seq -8"), (("--head-dim", "0"), "--head-dim 0"), (("--warmup", "-1"), "--warmup -1"),
    (("--kv-heads", "3"), "--kv-heads 3"), (("--modes", "ulysses,ulyses"), "'ulyses'"),
    (("--json", "{file}/out.json"), "--json {file}/out.json"), (("--plot", "{tmp}"), "--plot {tmp}"),
    (("--window", "0"), "--window 0"), (("--window", "8", "--no-causal"), "--window 8"),
], ids=["nproc0", "iters0", "batch0", "seq-neg", "head-dim0", "warmup-neg", "kv-heads", "modes", "json", "plot",
        "window0", "window-noncausal"])
def test_benchmark_rejects_bad_arguments(tmp_path, args, needle):
    """Exit status 2 and one line naming the bad value, before any rank starts (nothing on stdout,
    no JSON written)."""
    blocker = tmp_path / "a_file"
    blocker.write_text("")  # a path below a regular file cannot be created
    fill = {"file": str(blocker), "tmp": str(tmp_path)}
    args = [a.format(**fill) for a in args]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.cp_attention", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and needle.format(**fill) in lines[0], proc.stderr
    assert proc.stdout == "", proc.stdout[-2000:]  # no header: no rank ran
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]


# ------------------------------------------------------------------------------------------ MindSpore
def _ms_env(extra_pythonpath=None):
    """The environment for the benchmark under the MindSpore interpreter, as a user would start it:
    HP_PLATFORM=mindspore and no launcher variables (it starts its scheduler and workers itself)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("MS_", "RANK", "WORLD_SIZE", "MASTER_", "LOCAL_RANK"))
           and k not in ("PYTHONHOME", "VIRTUAL_ENV")}
    paths = [p for p in (extra_pythonpath, ROOT, env.get("PYTHONPATH")) if p]
    env.update(HP_PLATFORM="mindspore", PYTHONPATH=os.pathsep.join(paths), OMP_NUM_THREADS="1", GLOG_v="3")
    return env


def _run_ms(tmp_path, nproc, *extra, extra_pythonpath=None, timeout=240):
    from tests.mindspore.harness import mindspore_python, require_mindspore
    require_mindspore()
    out = tmp_path / "bench.json"
    cmd = [mindspore_python(), "-m", "benchmarks.cp_attention", "--nproc", str(nproc), "--seq", "64",
           "--heads", "4", "--head-dim", "8", "--iters", "1", "--warmup", "0", "--json", str(out), *extra]
    proc = subprocess.run(cmd, cwd=ROOT, env=_ms_env(extra_pythonpath), capture_output=True, text=True,
                          timeout=timeout)
    return proc, out


def _leftover_processes(marker):
    """Processes whose command line mentions ``marker`` (the run's tmp_path): orphaned ranks."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    found.append(int(pid))
        except OSError:
            pass
    return found


# every mode family once (MindSpore is slow on 2 cores; the modes' correctness has its own tests)
_MS_TWO = {"ulysses", "allgather", "allgather-lb", "ring-zigzag", "ulysses (raw)", "allgather-lb (raw)"}
_MS_FOUR = {"hybrid", "hybrid (raw)"}  # what 4 ranks add


@pytest.mark.mindspore
@pytest.mark.parametrize("nproc, extra, expected", [
    (2, ("--kv-heads", "2", "--no-causal", "--modes", ",".join(sorted(_MS_TWO | {"hybrid", "auto"}))),
     _MS_TWO),
    (4, ("--modes", ",".join(sorted(_MS_FOUR))), _MS_FOUR),
], ids=["2ranks-gqa-noncausal", "4ranks-causal-hybrid"])
def test_benchmark_mindspore_json(tmp_path, nproc, extra, expected):
    """HP_PLATFORM=mindspore under the MindSpore interpreter (no torch there): the launcher starts a
    scheduler and the workers, every mode that MindSpore supports runs and matches the reference."""
    proc, out = _run_ms(tmp_path, nproc, *extra)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    payload = json.loads(out.read_text())
    assert payload["platform"] == "mindspore" and payload["world"] == nproc
    rows = {r["mode"]: r for r in payload["rows"]}
    assert rows["reference (1 device)"]["ok"]
    assert expected | {"reference (1 device)"} <= set(rows), sorted(rows)
    for name in expected:
        row = rows[name]
        assert not row.get("skipped"), row
        assert row["ok"] and max(row["err_out"], row["err_grad"]) <= payload["tolerance"], row
        # emulated collectives (CPU) send at least the closed form, never less
        assert row["bytes_fwd"] >= row["formula_bytes"] > 0, row
        assert row["fwd_ms"] > 0 and row["fwd_bwd_ms"] > 0
        assert row["peak_mem_bytes"] is None, "MindSpore CPU has no allocator statistics"
    if nproc == 2:
        assert rows["allgather-lb"]["imbalance"] == pytest.approx(1.0)
        # all-gather is native on MindSpore CPU: counted bytes equal SPEC §8 exactly
        assert rows["allgather"]["bytes_fwd"] == pytest.approx(rows["allgather"]["formula_bytes"])
        assert rows["allgather"]["imbalance"] == pytest.approx(1.0)  # not causal
        assert "1 < 2 < world" in rows["hybrid"]["skipped"]
        # mode="auto" calibrates, tunes and runs on MindSpore too (its row is named after its choice)
        auto = [r for name, r in rows.items() if name.startswith("auto -> ")]
        assert len(auto) == 1 and auto[0]["ok"], sorted(rows)
    else:
        assert rows["hybrid"]["imbalance"] == pytest.approx(2.0)
    assert any("peak mem not measured" in n for n in payload["notes"])
    assert "formula" in proc.stdout and "emulated collectives" in proc.stdout  # header and table printed
    assert "[WARNING]" not in proc.stdout + proc.stderr  # MindSpore's log chatter is filtered


@pytest.mark.mindspore
def test_benchmark_mindspore_failing_rank_stops_the_run(tmp_path):
    """One rank raising mid-run leaves the others blocked in a collective: the launcher must stop
    them all and exit non-zero, promptly, leaving no process behind."""
    (tmp_path / "sitecustomize.py").write_text(
        "import os\n"
        "if os.environ.get('MS_NODE_ID') == '1':\n"
        "    import benchmarks.cp_attention as b\n"
        "    def _fail(self, mode):\n"
        "        raise RuntimeError('injected failure on rank 1')\n"
        "    b._Bench.run = _fail\n")
    proc, out = _run_ms(tmp_path, 2, "--modes", "ulysses", extra_pythonpath=str(tmp_path), timeout=180)
    assert proc.returncode != 0
    assert "injected failure on rank 1" in proc.stderr, proc.stderr[-3000:]
    assert "rank 1 exited with code 1" in proc.stderr, proc.stderr[-3000:]
    assert not out.exists()
    assert _leftover_processes(str(tmp_path)) == []


@pytest.mark.parametrize("name", ["cp_attention", "cp_overhead", "dtensor_dispatch", "ring_memory", "cp_launch"])
def test_benchmark_runs_as_a_file(name, tmp_path):
    """msrun starts a benchmark by its file path (``msrun ... benchmarks/cp_attention.py``), from any
    directory: the package must still import (it once failed with ModuleNotFoundError: benchmarks)."""
    import pathlib
    import subprocess
    import sys
    path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    done = subprocess.run([sys.executable, str(path), "--help"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr


def test_benchmark_auto_row_calibration_and_sweep(tmp_path):
    """--modes auto: a row named after the mode auto chose, exact, with that mode's closed form;
    --calibrate writes the numbers mode='auto' reads; --auto-sweep prints the choice per
    configuration and the share within 1.10x of the best fixed mode."""
    payload, _ = _run(tmp_path, "--modes", "ulysses,allgather,auto")
    auto = [r for r in payload["rows"] if r["mode"].startswith("auto -> ")]
    assert len(auto) == 1 and auto[0]["ok"] and auto[0]["bytes_fwd"] == pytest.approx(auto[0]["formula_bytes"])
    path = tmp_path / "calibration.json"
    base = [sys.executable, "-m", "benchmarks.cp_attention", "--nproc", "2", "--head-dim", "8", "--iters", "1",
            "--warmup", "0"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    done = subprocess.run(base + ["--calibrate", str(path)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    numbers = json.loads(path.read_text())
    assert numbers["flops"] > 0 and numbers["ds_bandwidth"] > 0 and "allgather" in numbers["overheads"]
    done = subprocess.run(base + ["--auto-sweep", "--sweep-heads", "2", "--sweep-seqs", "32"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "auto's choice within 1.10x of the best fixed mode" in done.stdout and done.stderr.count("auto -> ") == 4
