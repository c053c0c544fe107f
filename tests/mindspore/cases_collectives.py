"""MindSpore-only collective checks: on CPU the platform emulates all-to-all, reduce-scatter and
p2p from AllGather/AllReduce, and reports the bytes the emulation really sends under the logical
op's name. (The collectives' values and gradients are checked on every platform by
tests/cases/collectives.py.)"""
from tests.frameworks import inp, t


# =============================================================================== accounting
def bytes_and_capabilities(rank, world_size):
    """Emulated collectives report the bytes they really send, under the logical op's name."""
    from hyper_parallel.core.comm_mode import CommDebugMode
    from hyper_parallel.platform import get_platform
    platform = get_platform()
    caps = platform.capabilities()
    assert caps["backend"] == "mccl"
    for op in ("all_to_all_single", "reduce_scatter", "p2p (batch_isend_irecv)"):
        assert caps[op].startswith("emulated"), (op, caps[op])
    group = platform.new_group(range(world_size))
    n = world_size
    x = t(inp("bytes", rank, (4 * n, 3)))
    nbytes = 4 * n * 3 * 4
    with CommDebugMode() as comm:
        platform.all_gather(x, group)
        platform.all_reduce(x, group)
        platform.all_to_all_single(x, group)
        platform.reduce_scatter(x, group)
    expected_counts = {"all_gather": 1, "all_reduce": 1, "all_to_all": 1, "reduce_scatter": 1}
    assert comm.get_comm_counts() == expected_counts, comm.get_comm_counts()
    expected = {"all_gather": (n - 1) * nbytes, "all_reduce": 2 * nbytes * (n - 1) // n,
                "all_to_all": (n - 1) * nbytes, "reduce_scatter": 2 * nbytes * (n - 1) // n}
    assert comm.get_comm_bytes() == expected, (comm.get_comm_bytes(), expected)
    with CommDebugMode() as comm:
        platform.p2p_exchange([(x, (rank + 1) % n)], [(x, (rank - 1) % n)])
    # the size table (int64 n x 1 per rank) plus the padded payload, both all-gathered, plus one
    # 4-byte max all-reduce
    assert comm.get_comm_bytes()["send_recv"] == (n - 1) * (n * 8 + nbytes), comm.get_comm_bytes()
    return caps
