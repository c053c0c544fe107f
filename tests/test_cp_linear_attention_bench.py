"""``python -m benchmarks.cp_attention --kind gdn`` at tiny sizes on 4 ranks: each state mode's
bytes sent per rank equal the closed form (independent of the sequence length) and its output and
gradients are within the tolerance of the single-device rule."""
from tests.harness import run_dist


def _rows(rank, world_size, seqs):
    from benchmarks.cp_attention import parse_args
    from benchmarks.cp_linear import MODES, _LinearBench
    from hyper_parallel import get_platform, init_device_mesh
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
    sent = {}
    for seq in seqs:
        args = parse_args(["--kind", "gdn", "--seq", str(seq), "--heads", "4", "--kv-heads", "2",
                           "--head-dim", "4", "--iters", "1", "--warmup", "0"])
        bench = _LinearBench(args, mesh, get_platform())
        bench.reference()
        for mode in MODES:
            row = bench.run(mode)
            assert row["ok"], row
            assert row["bytes_fwd"] == row["formula_bytes"] > 0, row
            sent.setdefault(mode, set()).add(row["bytes_fwd"])
    assert all(len(values) == 1 for values in sent.values()), sent   # the same for every S
    return True


def test_gdn_benchmark_rows():
    assert run_dist(4, _rows, [16, 64]) == [True] * 4
