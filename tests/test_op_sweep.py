"""The op sweep: every OpInfo of PyTorch's operator database on DTensors against torch on the full
tensors (machinery and what is compared: tests/op_sweep.py).

In CI: every op, its first sample, two layouts (plus NaN / inf variants and the in-place form) on a
1-D mesh of 2 ranks, and a quarter of the ops on a 2x2 mesh. The full sweep (three samples, three
layouts, every op on both meshes) is opt-in: ``pytest tests/test_op_sweep.py -m op_sweep_full``.
Each run prints a table of ops — rule / fallback / error — at the end of the session (and writes
it to ``$HP_OP_SWEEP_TABLE`` when set). Any mismatch fails the test.
"""
import os
from collections import Counter

import pytest

from tests.harness import run_dist

pytest.importorskip("expecttest", reason="op_db needs expecttest (pip install -e '.[test]')")

TABLES = {}   # title -> {op: summary}; printed by conftest.pytest_terminal_summary
CHUNKS = 4


def sweep_chunk(rank, world_size, mesh_shape, shard, samples, layouts):
    from tests.op_sweep import sweep
    return sweep(rank, world_size, mesh_shape, shard=shard, samples=samples, layouts=layouts)


def _run(title, mesh_shape, every, samples, layouts):
    world = 1
    for n in mesh_shape:
        world *= n
    merged = {}
    for chunk in range(CHUNKS):
        per_rank = run_dist(world, sweep_chunk, mesh_shape, (chunk * every, CHUNKS * every), samples, layouts,
                            timeout=900)
        statuses = [{op: s["status"] for op, s in r.items()} for r in per_rank]
        assert all(s == statuses[0] for s in statuses), "ranks disagree on an op's outcome"
        for op, summary in per_rank[0].items():
            merged[op] = summary
            if any(r[op]["status"] == "MISMATCH" for r in per_rank):
                merged[op] = next(r[op] for r in per_rank if r[op]["status"] == "MISMATCH")
    TABLES[title] = merged
    bad = {op: s["mismatches"] for op, s in merged.items() if s["status"] == "MISMATCH"}
    assert not bad, f"{len(bad)} ops give a different answer than torch on one device:\n" + "\n\n".join(
        f"{op}: {m[0]}" for op, m in sorted(bad.items()))
    counts = Counter(s["status"] for s in merged.values())
    assert counts["rule"] + counts["fallback"] > len(merged) // 2, counts  # the sweep really ran ops
    return counts


@pytest.mark.timeout(1200)
def test_op_sweep_every_op_on_a_1d_mesh():
    _run("op sweep, mesh (2,), 1 sample x 2 layouts", (2,), every=1, samples=1, layouts=2)


@pytest.mark.timeout(1200)
def test_op_sweep_sampled_on_a_2d_mesh():
    _run("op sweep, mesh (2, 2), every 4th op", (2, 2), every=4, samples=1, layouts=1)


@pytest.mark.op_sweep_full
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("mesh_shape", [(2,), (4,), (2, 2)])
def test_op_sweep_full(mesh_shape):
    _run(f"full op sweep, mesh {mesh_shape}", mesh_shape, every=1, samples=3, layouts=3)


def format_tables():
    """The session's sweep tables: counts, then one line per op that is not plainly a rule."""
    lines = []
    for title, table in TABLES.items():
        counts = Counter(s["status"] for s in table.values())
        tally = ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
        lines.append(f"{title}: {len(table)} ops: {tally}")
        for op, s in sorted(table.items()):
            if s["status"] == "fallback":
                lines.append(f"  fallback  {op:<40} {', '.join(s['fallback'])[:100]}")
            elif s["status"] in ("error", "MISMATCH"):
                first = (s["errors"] or s["mismatches"] or [""])[0].split("\n")[0]
                lines.append(f"  {s['status']:<9} {op:<40} {first[:140]}")
    text = "\n".join(lines)
    path = os.environ.get("HP_OP_SWEEP_TABLE")
    if path and text:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    return text
