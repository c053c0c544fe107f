"""The benchmark's ``ring`` line: does the ring hide its hops behind block compute?

Measured in the same run as the ring row, on the same local blocks:

* **local compute**: ``ring_attention`` forward+backward on a ring of P positions that all name
  this rank, so the same kernels run with the same causal skips and every hop is a local copy;
* **raw P2P**: the ring's hops alone with the platform's point-to-point exchange, no compute:
  P-1 K/V hops in forward, P-1 K/V hops and P-1 dK/dV hops in backward, in the input dtype.

A ring that overlaps perfectly costs max(compute, P2P); the line prints its fwd+bwd time over
that bound (goal <= 1.15x). The slowest rank counts for every number.
"""
from hyper_parallel.core.context_parallel.ring.ring_attention import RingLayout, ring_attention
from hyper_parallel.platform import get_platform

GOAL = 1.15


def _bnsd(t):
    return t.swapaxes(1, 2)


def _compute_only(bench, causal):
    """fwd+bwd of this rank's ring schedule with every hop a local copy."""
    rank, P = bench.platform.get_rank(), bench.world
    layout = RingLayout((rank,) * P, bench.rank)

    def run(q, k, v):
        return _bnsd(ring_attention(_bnsd(q), _bnsd(k), _bnsd(v), layout, causal))
    return run


def _hops_only(bench, k, v):
    """The ring's hops without compute: 3·(P-1) exchanges of a K-sized and a V-sized block."""
    platform = get_platform()
    ranks = list(range(bench.world))
    me = bench.rank
    nxt, prev = ranks[(me + 1) % bench.world], ranks[(me - 1) % bench.world]
    blocks = (k.contiguous(), v.contiguous())

    def run():
        held = blocks
        for _ in range(3 * (bench.world - 1)):
            held = tuple(platform.p2p_exchange([(t, nxt) for t in held], [(t, prev) for t in held]))
        return held
    return run


def ring_overlap_line(bench, ring_row):
    """{ring fwd+bwd, compute, p2p, ratio} for the ring row just run, or None without one."""
    if ring_row is None or ring_row.get("skipped") or ring_row.get("fwd_bwd_ms") is None:
        return None
    blocks = [bench._block(t) for t in bench.full]
    grad = bench._block(bench.grad_out)
    fw = bench.fw
    compute = _compute_only(bench, bench.args.causal)
    compute_ms = bench._time(lambda: fw.forward_backward(compute, blocks, grad))
    p2p_ms = bench._time(_hops_only(bench, blocks[1], blocks[2]))
    bound = max(compute_ms, p2p_ms)
    return {"ring_fwd_bwd_ms": ring_row["fwd_bwd_ms"], "compute_ms": compute_ms, "p2p_ms": p2p_ms,
            "ratio": ring_row["fwd_bwd_ms"] / bound if bound else None, "goal": GOAL}


def format_line(line):
    if line is None:
        return []
    ratio = "n/a" if line["ratio"] is None else f"{line['ratio']:.2f}x"
    return [f"ring: fwd+bwd {line['ring_fwd_bwd_ms']:.1f} ms vs max(local compute "
            f"{line['compute_ms']:.1f} ms, "
            f"raw P2P {line['p2p_ms']:.1f} ms) = {ratio} (goal <= {line['goal']:.2f}x; the ring row's time "
            f"includes the framework's own dispatch)"]
