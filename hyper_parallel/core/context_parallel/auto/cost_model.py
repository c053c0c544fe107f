"""The predicted time of each context-parallel mode for one attention call (forward + backward).

time = compute + communication, per rank, on the slowest rank:
- compute: the attention's multiply-adds (4·B·H·S²·D forward for q·kᵀ and p·v, twice that
  backward; half of it causal) divided over the P ranks, times the mode's causal imbalance — the
  rank holding the last query block does (2P−1)/P of the average in all-gather KV without load
  balancing, and the plain ring's lock-step steps cost the same; Ulysses, load balancing and zigzag
  are balanced — at the calibrated rate; where ranks share cores (calibrated contention c: the
  kernel's time with every rank computing over one rank's alone) a rank's idle time speeds the
  others, so imbalance costs only beyond c;
- communication: the closed forms of docs/context_parallel.md (bytes per rank, forward; backward
  the same, the ring's twice) at the rate calibrated for the mode's own collective on the groups it
  uses (the all-to-all on ``u`` adjacent ranks, the all-gather and the reduce-scatter on ``P/u``
  strided ranks; P2P hops and the load balance's exchanges at a pair's rate), plus one latency per
  collective step (the ring: P−1 hops each way) unless the overhead below was calibrated (it was
  timed on a tiny call, so it holds them already); the ring overlaps its hops with block
  compute, so it pays compute + communication − o · min(compute, communication), o the calibrated
  share of a transfer that hides under compute (1 where transfers have their own engine: the max of
  the two; 0 where they compete for the cores: the sum);
- overhead: what one call of the mode costs beyond that (kernel launches, the ring's steps, the
  framework's own work), calibrated on a tiny input — at short sequences it decides;
- memory: the k/v a rank holds (all-gather KV: the whole sequence of k and v; Ulysses: all tokens of
  its heads; ring: two blocks), refused above ``memory_budget``.
Candidates that cannot run are never offered: q heads the Ulysses degree does not divide, an odd
local length with load balancing, q and k/v of different lengths in the ring.
"""
from typing import Any
from dataclasses import dataclass
from enum import Enum


@dataclass(frozen=True)
class CallShape:
    batch: int
    q_len: int          # global sequence lengths
    kv_len: int
    q_heads: int
    kv_heads: int
    head_dim: int
    v_head_dim: int
    itemsize: int
    causal: bool


class Family(str, Enum):
    """A candidate's mode family (the calibration times one per family); the value is its printed name."""
    ULYSSES = "ulysses"
    ALLGATHER = "allgather"
    ALLGATHER_LB = "allgather-lb"
    RING = "ring"
    RING_ZIGZAG = "ring-zigzag"
    HYBRID = "hybrid"
    HYBRID_RING = "hybrid-ring"


_HYBRIDS = (Family.HYBRID, Family.HYBRID_RING)


@dataclass(frozen=True)
class Candidate:
    family: Family
    ulysses_degree: int
    kv_exchange: str
    load_balance: bool

    def __post_init__(self) -> None:
        object.__setattr__(self, "family", Family(self.family))   # the family's printed name also works

    @property
    def name(self) -> str:
        """The printed name: the family, with the Ulysses degree for the hybrids (``hybrid(ds=2)``)."""
        if self.family in _HYBRIDS:
            return f"{self.family.value}(ds={self.ulysses_degree})"
        return self.family.value

    def kwargs(self) -> Any:
        return {"ulysses_degree": self.ulysses_degree, "kv_exchange": self.kv_exchange,
                "load_balance": self.load_balance}


def candidates(shape: Any, cp: Any) -> Any:
    """Every mode that can run this call on ``cp`` ranks."""
    out = []
    local = shape.q_len // cp
    for ds in (d for d in range(cp, 0, -1) if cp % d == 0 and shape.q_heads % d == 0):
        if ds == cp:
            out.append(Candidate(Family.ULYSSES, ds, "allgather", False))
            continue
        out.append(Candidate(Family.ALLGATHER if ds == 1 else Family.HYBRID, ds, "allgather", False))
        if ds == 1 and local % 2 == 0:
            out.append(Candidate(Family.ALLGATHER_LB, 1, "allgather", True))
        if shape.q_len == shape.kv_len:
            out.append(Candidate(Family.RING if ds == 1 else Family.HYBRID_RING, ds, "ring", False))
            if ds == 1 and local % 2 == 0:
                out.append(Candidate(Family.RING_ZIGZAG, 1, "ring", True))
    return out


def _compute_seconds(shape, cp, candidate, machine):
    pairs = shape.q_len * shape.kv_len * (0.5 if shape.causal else 1.0)
    flops = 3 * 2 * shape.batch * shape.q_heads * pairs * (shape.head_dim + shape.v_head_dim)
    imbalance = 1.0
    if shape.causal and not candidate.load_balance and candidate.ulysses_degree < cp:
        co = cp // candidate.ulysses_degree
        imbalance = (2 * co - 1) / co
    # ranks sharing cores: the average rank's work at the shared rate (machine.flops), or the
    # busiest rank's at the rate it gets while the others idle, whichever is longer
    return flops / cp * max(imbalance / machine.contention, 1.0) / machine.flops


def _elements(shape, cp, candidate):
    """(elements over the Ulysses dim, over the gather / ring dim, of the load balance's pair
    exchanges) one rank sends in a forward (docs/context_parallel.md's closed forms)."""
    B, D, Dv = shape.batch, shape.head_dim, shape.v_head_dim
    u = candidate.ulysses_degree
    r = cp // u
    hkv = shape.kv_heads if shape.kv_heads % u == 0 else _lcm(shape.kv_heads, u)
    s_local = shape.q_len / cp
    ulysses = (u - 1) / u * B * s_local * (shape.q_heads * (D + Dv) + hkv * (D + Dv)) if u > 1 else 0.0
    gather = (r - 1) / r * B * shape.kv_len * hkv * (D + Dv) / u if r > 1 else 0.0
    balance = 2 * B * (shape.q_len / (2 * cp)) * shape.q_heads * Dv if candidate.load_balance else 0.0
    return ulysses, gather, balance


def _communication_seconds(shape, cp, candidate, machine):
    """(seconds on the Ulysses dim, on the gather / ring dim) of a forward + backward: each mode's
    own collective at the rate calibrated on the groups it uses."""
    ulysses, gather, balance = _elements(shape, cp, candidate)
    size, u = shape.itemsize, candidate.ulysses_degree
    r = cp // u
    # a calibrated per-mode overhead was timed on a tiny call, so it already holds every
    # collective's latency: count them again only where it is missing
    steps = 0.0 if machine.overheads else 1.0
    pair_byte, pair_latency = 1.0 / machine.bandwidth("co"), steps * machine.latency("co")
    u_time = 0.0
    if u > 1:   # q, k, v in and the output back, forward and backward: two all-to-all steps each
        per_byte, latency = machine.rate("all_to_all", "ds", u)
        u_time = 2 * (ulysses * size * per_byte + 2 * steps * latency)
    g_time = 2 * (balance * size * pair_byte + 2 * pair_latency) if balance else 0.0
    if r > 1 and candidate.kv_exchange == "ring":   # P2P hops: r−1 each way, backward twice forward
        g_time += 3 * (gather * size * pair_byte + (r - 1) * pair_latency)
    elif r > 1:   # all-gather forward, reduce-scatter of dK, dV backward (the same bytes)
        for kind in ("all_gather", "reduce_scatter"):
            per_byte, latency = machine.rate(kind, "co", r)
            g_time += gather * size * per_byte + steps * latency
    return u_time, g_time


def _lcm(a, b):
    import math
    return a * b // math.gcd(a, b)


def predict(shape: Any, cp: Any, candidate: Any, machine: Any) -> Any:
    """(seconds, bytes of k/v held per rank) for one forward + backward of the call."""
    compute = _compute_seconds(shape, cp, candidate, machine)
    u_time, g_time = _communication_seconds(shape, cp, candidate, machine)
    if candidate.kv_exchange == "ring":   # the hops hide under block compute, as far as they can
        seconds = u_time + compute + g_time - machine.overlap * min(compute, g_time)
    else:
        seconds = compute + u_time + g_time
    return seconds + machine.overhead(family(candidate)), _held_bytes(shape, cp, candidate)


def family(candidate: Any) -> str:
    """The candidate's family's printed name (the calibration times one per family)."""
    return str(candidate.family.value)


def _held_bytes(shape, cp, candidate):
    u = candidate.ulysses_degree
    kv_heads = max(shape.kv_heads // u, 1) if shape.kv_heads % u == 0 else _lcm(shape.kv_heads, u) // u
    per_token = shape.batch * kv_heads * (shape.head_dim + shape.v_head_dim) * shape.itemsize
    if candidate.kv_exchange == "ring":
        tokens = 2 * shape.kv_len / cp * u   # the held block and the one in flight
    else:
        tokens = shape.kv_len
    return per_token * tokens
