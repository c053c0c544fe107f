"""The context-parallel modes the benchmark runs, each in two forms.

* framework: ``ContextParallel`` applied to an ordinary attention module;
* raw: the same algorithm written by hand with the platform's differentiable collectives only,
  the yardstick for the framework's own overhead.

Each mode also knows its closed-form communication volume (docs/context_parallel.md, "Communication
volume per rank") and the causal work each rank's kernel does (for the imbalance column). Tensors
are reached only through the framework adapter (``cp_frameworks``), so the same modes run on torch
and on MindSpore.
"""
from dataclasses import dataclass
from typing import Callable

from hyper_parallel import ContextParallel
from hyper_parallel.platform import get_platform

SEQ, HEAD = 1, 2  # BSHD


@dataclass
class Mode:
    name: str
    ulysses: object          # ulysses_degree for ContextParallel
    load_balance: bool
    raw: bool
    kv_exchange: str = "allgather"
    overlap: bool = False    # ContextParallel(overlap=True): head chunks pipelined (name ends -overlap)

    @property
    def base(self):
        """The algorithm's name: the same for its raw and overlapped forms."""
        return self.name.replace(" (raw)", "").replace("-overlap", "")

    def supported(self, cfg, world, fw):
        """None if this mode runs at this size on the framework adapter ``fw``, else why not."""
        ds = world if self.ulysses is None else self.ulysses
        if world % ds or self.name.startswith("hybrid") != (1 < ds < world) or (self.kv_exchange == "ring" and
                                                                                ds == world):
            return f"needs a world that ulysses_degree={ds} divides with 1 < {ds} < world"
        if cfg.heads % ds or cfg.kv_heads % ds:
            return f"heads {cfg.heads}/{cfg.kv_heads} not divisible by {ds}"
        if cfg.seq % (2 * world if self.load_balance else world):
            return f"seq {cfg.seq} not divisible into {2 * world if self.load_balance else world} blocks"
        if getattr(cfg, "window", None) and self.raw:
            return "the raw forms have no sliding window"
        return None

    def build(self, cfg, mesh, fw) -> Callable:
        if self.raw:
            return RAW[self.name.replace(" (raw)", "")](cfg, mesh, fw)
        module = fw.attention(cfg.causal, cfg.kv_heads != cfg.heads, getattr(cfg, "window", None))
        ContextParallel(seq_dim=SEQ, head_dim=HEAD, ulysses_degree=self.ulysses,
                        load_balance=self.load_balance, kv_exchange=self.kv_exchange,
                        overlap=self.overlap).apply(module, mesh)
        return module

    def formula_elements(self, cfg, world):
        """Elements one rank sends in one forward: the closed form of docs/context_parallel.md."""
        B, S, P, hq, hkv, D = cfg.batch, cfg.seq, world, cfg.heads, cfg.kv_heads, cfg.head_dim
        base = self.base
        if base == "ulysses":
            return (P - 1) / P * B * (S / P) * D * (2 * hq + 2 * hkv)
        if base == "ring":  # one K/V block a hop; a window stops the ring early
            return self.ring_hops(cfg, P) * 2 * B * (S / P) * hkv * D
        if base in ("allgather", "allgather-lb", "ring-zigzag"):
            volume = 2 * (P - 1) / P * B * S * hkv * D
            if base == "allgather-lb":
                volume += 2 * B * (S / (2 * P)) * hq * D
            if base == "ring-zigzag":  # q, k, v halves in and the output half back
                volume += B * (S / (2 * P)) * D * (2 * hq + 2 * hkv) if P > 1 else 0
            return volume
        u = self.ulysses
        r = P // u
        hops = self.ring_hops(cfg, r) if self.kv_exchange == "ring" else r - 1
        return (u - 1) / u * B * (S / P) * D * (2 * hq + 2 * hkv) + 2 * hops / r * B * S * hkv * D / u

    def ring_hops(self, cfg, ring_size):
        """K/V hops one rank sends forward on a contiguous ring of ``ring_size`` blocks: every other
        block, or under a causal window of w keys only the ceil((w - 1) / L) blocks before its own
        (L = S / ring_size) -- the steps ``ring_steps`` takes (docs: "Sliding window")."""
        window = getattr(cfg, "window", None)
        if not window or not cfg.causal:
            return ring_size - 1
        return min(ring_size - 1, -(-(window - 1) // (cfg.seq // ring_size)))

    def causal_work(self, cfg, world, rank):
        """(query, key) pairs the kernel visits on this rank, per head group: whole blocks up to the
        diagonal, or under a sliding window the pairs inside it."""
        S, P = cfg.seq, world
        base = self.base
        if not cfg.causal or base.startswith("ulysses"):
            return 1.0
        if base.startswith("hybrid"):
            block = S // (P // self.ulysses)
            rows = [(block * (rank // self.ulysses), block)]
        elif base in ("allgather-lb", "ring-zigzag"):
            c = S // (2 * P)
            rows = [(c * rank, c), (c * (2 * P - 1 - rank), c)]
        else:
            rows = [(S // P * rank, S // P)]
        window = getattr(cfg, "window", None)
        if window is None:
            return float(sum(n * (start + n) for start, n in rows))
        return float(sum(_visible_pairs(start, n, window) for start, n in rows))


def _visible_pairs(start, rows, window):
    """Keys the causal query rows [start, start + rows) see, each at most ``window`` of them."""
    def up_to(n):  # sum of min(i + 1, w) for i < n
        if window is None or n <= window:
            return n * (n + 1) // 2
        return window * (window + 1) // 2 + (n - window) * window
    return up_to(start + rows) - up_to(start)


MODES = [
    Mode("ulysses", None, False, False),
    Mode("allgather", 1, False, False),
    Mode("allgather-lb", 1, True, False),
    Mode("hybrid", 2, False, False),
    Mode("ring", 1, False, False, "ring"),
    Mode("ring-zigzag", 1, True, False, "ring"),
    Mode("hybrid-ring", 2, False, False, "ring"),
    Mode("ulysses-overlap", None, False, False, overlap=True),
    Mode("allgather-overlap", 1, False, False, overlap=True),
    Mode("hybrid-overlap", 2, False, False, overlap=True),
    Mode("ulysses (raw)", None, False, True),
    Mode("allgather (raw)", 1, False, True),
    Mode("allgather-lb (raw)", 1, True, True),
    Mode("hybrid (raw)", 2, False, True),
]


# ---------------------------------------------------------------------------------------- raw forms
def _offset_attention(fw, q, k, v, row_start, causal, gqa):
    """Query rows [row_start, row_start+L) against all keys, global causal mask."""
    if not causal:
        return fw.sdpa(q, k, v, False, gqa)
    rows = q.shape[SEQ]
    visible = row_start + rows
    k, v = k[:, :visible], v[:, :visible]
    if row_start == 0:
        return fw.sdpa(q, k, v, True, gqa)
    return fw.sdpa(q, k, v, False, gqa, fw.causal_mask(rows, visible, row_start))


def raw_ulysses(cfg, mesh, fw):
    platform, group = get_platform(), mesh.get_group(0)
    gqa = cfg.kv_heads != cfg.heads

    def run(q, k, v):
        q, k, v = (platform.differentiable_all_to_all(t, group, HEAD, SEQ) for t in (q, k, v))
        out = fw.sdpa(q, k, v, cfg.causal, gqa)
        return platform.differentiable_all_to_all(out, group, SEQ, HEAD)
    return run


def raw_ulysses_fused(cfg, mesh, fw):
    """Ulysses with q, k, v in one all-to-all, written by hand (as DeepSpeed/Megatron do): each
    tensor's heads cut into the P rank blocks, block j of q, k, v side by side, one all-to-all,
    then each tensor's heads sliced out. Not in MODES (cp_attention's table); cp_overhead times it
    beside the per-tensor form, since ContextParallel fuses the three as well."""
    platform, group, P = get_platform(), mesh.get_group(0), mesh.size()
    gqa = cfg.kv_heads != cfg.heads

    def run(q, k, v):
        widths = [t.shape[HEAD] // P for t in (q, k, v)]
        blocks = [t.reshape(t.shape[0], t.shape[1], P, w, t.shape[3]) for t, w in zip((q, k, v), widths)]
        packed = fw.cat(blocks, HEAD + 1)
        packed = packed.reshape(q.shape[0], q.shape[1], P * sum(widths), q.shape[3])
        moved = platform.differentiable_all_to_all(packed, group, HEAD, SEQ)
        starts = [0, widths[0], widths[0] + widths[1]]
        q, k, v = (moved[:, :, s:s + w] for s, w in zip(starts, widths))
        out = fw.sdpa(q, k, v, cfg.causal, gqa)
        return platform.differentiable_all_to_all(out, group, SEQ, HEAD)
    return run


def raw_allgather(cfg, mesh, fw):
    platform, group = get_platform(), mesh.get_group(0)
    rank, gqa = mesh.get_local_rank(0), cfg.kv_heads != cfg.heads

    def run(q, k, v):
        k, v = (platform.differentiable_all_gather(t, group, SEQ) for t in (k, v))
        return _offset_attention(fw, q, k, v, rank * q.shape[SEQ], cfg.causal, gqa)
    return run


def raw_allgather_lb(cfg, mesh, fw):
    platform, group = get_platform(), mesh.get_group(0)
    P, rank, gqa = mesh.size(), mesh.get_local_rank(0), cfg.kv_heads != cfg.heads
    partner = mesh.group_ranks(0)[P - 1 - rank]

    def swap(t):
        if partner == mesh.get_rank():
            return t
        return platform.differentiable_p2p_exchange(t.contiguous(), partner, partner)

    def run(q, k, v):
        k, v = (platform.differentiable_all_gather(t, group, SEQ) for t in (k, v))
        head, second = fw.chunk(q, 2, SEQ)
        tail = swap(second)
        c = head.shape[SEQ]
        out_head = _offset_attention(fw, head, k, v, 2 * rank * c, cfg.causal, gqa)
        out_tail = _offset_attention(fw, tail, k, v, (2 * P - 1 - 2 * rank) * c, cfg.causal, gqa)
        return fw.cat([out_head, swap(out_tail)], SEQ)
    return run


def raw_hybrid(cfg, mesh, fw):
    platform = get_platform()
    ds = 2
    grid = mesh._unflatten(0, (mesh.size() // ds, ds), ("co", "ds"))
    co_group, ds_group = grid.get_group("co"), grid.get_group("ds")
    co_rank, gqa = grid.get_local_rank("co"), cfg.kv_heads != cfg.heads

    def run(q, k, v):
        q, k, v = (platform.differentiable_all_to_all(t, ds_group, HEAD, SEQ) for t in (q, k, v))
        k, v = (platform.differentiable_all_gather(t, co_group, SEQ) for t in (k, v))
        out = _offset_attention(fw, q, k, v, co_rank * q.shape[SEQ], cfg.causal, gqa)
        return platform.differentiable_all_to_all(out, ds_group, SEQ, HEAD)
    return run


RAW = {"ulysses": raw_ulysses, "allgather": raw_allgather, "allgather-lb": raw_allgather_lb,
       "hybrid": raw_hybrid}
# second raw forms, timed by cp_overhead beside the first (no row in cp_attention's table)
RAW_FUSED = {"ulysses": raw_ulysses_fused}
