"""The machine numbers the cost model needs, measured once per mesh (and cached) or read from a file.

A short calibration runs on the CP mesh the first time ``mode="auto"`` meets it: all-reduces of a
few bytes (latency) and of a few MB (bandwidth) within a pair of adjacent ranks ("ds") and of
strided ranks ("co"); then each mode's own collective on each group it would use — the all-to-all
on every Ulysses group of ``u`` adjacent ranks, the all-gather and reduce-scatter on every gather
group of ``P/u`` strided ranks — since a collective over more ranks can move a byte slower than a
pair does (ranks sharing cores or a link, a ring or tree algorithm's extra steps); a small
attention for the compute rate (with every rank computing, and on rank 0 alone: whether ranks
share cores), the same attention beside an all-reduce in flight (how much of a transfer hides
under compute), and each mode once on a tiny input: what a call costs beyond its compute and bytes
(kernel launches, the ring's steps, the framework's own work) — at short sequences that decides.
Every rank then takes the slowest rank's value (one all-reduce), so every rank ranks the
candidates alike and makes the same choice. ``python -m benchmarks.cp_attention --calibrate
PATH`` writes the same numbers to a JSON file that ``ContextParallel(mode="auto", calibration=PATH)``
(or ``HP_CP_CALIBRATION=PATH``) reads instead of measuring.
"""
from typing import Any
import json
import math
import os
import statistics
import time
from dataclasses import asdict, dataclass, replace

from hyper_parallel.core.bounded_cache import BoundedCache
from hyper_parallel.core.context_parallel.auto.tuning import outside_user_state, stand_in
from hyper_parallel.core.context_parallel.mode import run_attention
from hyper_parallel.platform import get_platform

_MEASURED = BoundedCache(64)
ENV = "HP_CP_CALIBRATION"


@dataclass(frozen=True)
class Machine:
    flops: float                 # multiply-adds ×2 per second of the attention kernel
    ds_bandwidth: float          # bytes per second, adjacent ranks
    ds_latency: float            # seconds per collective, adjacent ranks
    co_bandwidth: float          # strided ranks
    co_latency: float
    overheads: tuple = ()        # (mode family, seconds of a forward + backward of a tiny call)
    # the kernel's time with every rank computing / with one rank computing alone: 1 where each rank
    # has its own device, above 1 where ranks share cores (then a rank's idle time speeds the others
    # and imbalance up to this factor costs nothing)
    contention: float = 1.0
    # the share of a collective hidden under compute running beside it: 1 where the transfer has its
    # own engine (the ring then pays max(compute, communication)), 0 where it competes for the cores
    overlap: float = 1.0
    # ("kind/dim/size", seconds per byte sent by a rank, latency) of each mode's own collective on the
    # groups it uses: kind all_to_all (dim ds) or all_gather / reduce_scatter (dim co), size its ranks
    collectives: tuple = ()

    def rate(self, kind: Any, dim: Any, size: Any) -> Any:
        """(seconds per byte a rank sends, seconds per call) of ``kind`` on a ``dim`` group of ``size``
        ranks: measured where calibrated, else the pair's all-reduce numbers."""
        for key, per_byte, latency in self.collectives:
            if key == f"{kind}/{dim}/{size}":
                return per_byte, latency
        return 1.0 / self.bandwidth(dim), self.latency(dim)

    def overhead(self, family: Any) -> Any:
        found = dict(self.overheads)
        return found.get(family, max(found.values()) if found else 0.0)

    def bandwidth(self, dim: Any) -> Any:
        return self.ds_bandwidth if dim == "ds" else self.co_bandwidth

    def latency(self, dim: Any) -> Any:
        return self.ds_latency if dim == "ds" else self.co_latency

    def save(self, path: Any) -> None:
        values = asdict(self)
        values["overheads"] = dict(self.overheads)
        values["collectives"] = {key: [per_byte, latency] for key, per_byte, latency in self.collectives}
        with open(path, "w") as f:
            json.dump(values, f, indent=1)

    @classmethod
    def load(cls, path: Any) -> Any:
        """The numbers of a file ``save`` wrote; ValueError naming the file and the field for anything
        missing, not a number, NaN, infinite or out of range (a zero bandwidth would divide by zero,
        a NaN would rank every mode alike)."""
        values = _read(path)
        optional = ("overheads", "collectives", "contention", "overlap")   # files older than these
        numbers = [k for k in cls.__dataclass_fields__ if k not in optional]
        missing = [k for k in numbers if k not in values]
        if missing:
            raise ValueError(f"calibration file {path} lacks {missing}; {_REWRITE.format(path=path)}")
        fields = {k: _number(path, k, values[k], *_RANGES[k]) for k in numbers}
        fields.update({k: _number(path, k, values[k], *_RANGES[k]) for k in optional[2:] if k in values})
        overheads = _table(path, "overheads", values.get("overheads", {}), 1)
        collectives = _table(path, "collectives", values.get("collectives", {}), 2)
        return cls(**fields, overheads=tuple(sorted((k, v[0]) for k, v in overheads)),
                   collectives=tuple(sorted((k, v[0], v[1]) for k, v in collectives)))


_REWRITE = "write it again with python -m benchmarks.cp_attention --calibrate {path}"
_POSITIVE, _NON_NEGATIVE = (0.0, None, False), (0.0, None, True)
# (lowest, highest, whether the lowest itself is allowed) of each number in a calibration file
_RANGES = {"flops": _POSITIVE, "ds_bandwidth": _POSITIVE, "co_bandwidth": _POSITIVE,
           "ds_latency": _NON_NEGATIVE, "co_latency": _NON_NEGATIVE, "contention": _POSITIVE,
           "overlap": (0.0, 1.0, True)}


def _read(path):
    try:
        with open(path) as f:
            values = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"calibration file {path} cannot be read as JSON ({e}); "
                         f"{_REWRITE.format(path=path)}") from None
    if not isinstance(values, dict):
        raise ValueError(f"calibration file {path} holds a {type(values).__name__}, not the object "
                         f"of named numbers --calibrate writes; {_REWRITE.format(path=path)}")
    return values


def _number(path, field, value, lowest, highest=None, lowest_allowed=True):
    """``value`` as a float; ValueError naming the file and the field unless finite and in range."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (value >= lowest if lowest_allowed else value > lowest)
    ok = ok and (highest is None or value <= highest)
    if not ok:
        bound = f">= {lowest}" if lowest_allowed else f"> {lowest}"
        bound += f" and <= {highest}" if highest is not None else ""
        raise ValueError(f"calibration file {path}: {field} = {value!r} must be a finite number {bound}; "
                         f"{_REWRITE.format(path=path)}")
    return float(value)


def _table(path, field, table, width):
    """[(name, [numbers])] of a {name: number} (width 1) or {name: [per_byte, latency]} field."""
    if not isinstance(table, dict):
        raise ValueError(f"calibration file {path}: {field} must be an object of named numbers; "
                         f"{_REWRITE.format(path=path)}")
    out = []
    for name, entry in table.items():
        entry = [entry] if width == 1 else entry
        if not isinstance(entry, list) or len(entry) != width:
            what = "a number" if width == 1 else f"[{width} numbers]"
            raise ValueError(f"calibration file {path}: {field}[{name!r}] = {entry!r} must be {what}; "
                             f"{_REWRITE.format(path=path)}")
        out.append((str(name), [_number(path, f"{field}[{name!r}]", v, *_NON_NEGATIVE) for v in entry]))
    return out


def machine_for(mesh: Any, path: Any = None, make_style: Any = None) -> Any:
    """The calibration of ``mesh``: from ``path`` / $HP_CP_CALIBRATION, else measured once
    (``make_style(**mode_kwargs)``: a fixed-mode ContextParallel, for the modes' overheads)."""
    path = path or os.environ.get(ENV)
    if path:
        return Machine.load(path)
    key = mesh.to_hash()
    if key not in _MEASURED:
        with outside_user_state():   # the first call may come inside the user's masks, no_grad, autocast
            _MEASURED[key] = measure(mesh, make_style=make_style)
    return _MEASURED[key]


def _seconds(run, repeats=1, samples=5):
    """Seconds per ``run()``: the median of ``samples`` timings of ``repeats`` runs each (a median,
    so that one disturbed sample on a shared machine does not steer every later choice)."""
    platform = get_platform()
    run()   # warm-up: first-call costs are not the machine's
    timings = []
    for _ in range(samples):
        platform.synchronize()   # accelerators run kernels asynchronously: time them, not their launch
        start = time.perf_counter()
        for _ in range(repeats):
            run()
        platform.synchronize()
        timings.append((time.perf_counter() - start) / repeats)
    return statistics.median(timings)


def _group_timing(platform, group, nbytes):
    small = platform.zeros((1,), dtype=platform.float32())
    large = platform.zeros((max(nbytes // 4, 1),), dtype=platform.float32())
    latency = _seconds(lambda: platform.all_reduce(small, group, tag="calibration"))
    full = _seconds(lambda: platform.all_reduce(large, group, tag="calibration"))
    return latency, max(full - latency, 1e-9)


def _groups(mesh):
    """(adjacent-ranks group, strided-ranks group) of the 1-D CP mesh (each this rank's pair)."""
    cp = mesh.size()
    if cp < 2:
        return None, None
    # two ranks: both dims are the one pair (a strided group of one rank would time nothing and
    # make the gather look free); an odd count: the whole mesh for both
    sub = mesh._unflatten(0, (cp // 2, 2), ("co", "ds")) if cp % 2 == 0 and cp > 2 else None
    if sub is None:
        return mesh.get_group(0), mesh.get_group(0)
    return sub.get_group("ds"), sub.get_group("co")


def measure(mesh: Any, nbytes: Any = 1 << 22, make_style: Any = None) -> Any:
    """Measure on every rank, then take the slowest rank's numbers everywhere (one all-reduce)."""
    platform = get_platform()
    families = _families(mesh.size()) if make_style is not None else []
    ds, co = _groups(mesh)
    values = [1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0]   # s/flop, per-byte and latency per group, contention,
    values[0], values[5] = _compute(platform, mesh)   # hidden share (negated: the all-reduce takes the max)
    for i, group in enumerate((ds, co)):
        if group is not None:
            latency, full = _group_timing(platform, group, nbytes)
            # an all-reduce moves about 2·(n−1)/n of the buffer per rank: 1 for a pair
            values[1 + 2 * i], values[2 + 2 * i] = full / nbytes, latency
    if co is not None:
        values[6] = -_overlap(platform, co, nbytes)
    collectives = _collective_timings(platform, mesh, nbytes)
    for _, per_byte, latency in collectives:
        values += [per_byte, latency]
    values += [_mode_seconds(make_style(**kwargs), mesh) for _, kwargs in families]
    slowest = platform.all_reduce(platform.tensor(values, dtype=platform.float32()), mesh.get_group(0),
                                  "max", tag="calibration")
    v = [float(x) for x in slowest.tolist()]
    first = 7 + 2 * len(collectives)
    return Machine(flops=1.0 / v[0], ds_bandwidth=1.0 / max(v[1], 1e-15), ds_latency=v[2],
                   co_bandwidth=1.0 / max(v[3], 1e-15), co_latency=v[4], contention=v[5], overlap=-v[6],
                   collectives=tuple((key, v[7 + 2 * i], v[8 + 2 * i])
                                     for i, (key, _, _) in enumerate(collectives)),
                   overheads=tuple((name, seconds) for (name, _), seconds in zip(families, v[first:])))


def _mode_groups(mesh):
    """{(dim, size): this rank's group} of every Ulysses group ("ds": ``u`` adjacent ranks) and
    gather group ("co": ``P/u`` strided ranks) some mode on this mesh uses, for each ``u`` dividing P."""
    cp, groups = mesh.size(), {}
    if cp < 2:
        return groups
    for u in (d for d in range(1, cp + 1) if cp % d == 0):
        if u in (1, cp):
            groups[("ds" if u == cp else "co", cp)] = mesh.get_group(0)
            continue
        sub = mesh._unflatten(0, (cp // u, u), ("co", "ds"))
        groups[("ds", u)], groups[("co", cp // u)] = sub.get_group("ds"), sub.get_group("co")
    return groups


def _collective_timings(platform, mesh, nbytes):
    """[("kind/dim/size", seconds per byte a rank sends, latency)] of each mode's own collectives: the
    all-to-all on Ulysses groups, the all-gather (forward) and reduce-scatter (its backward) on gather
    groups. A rank sends (g−1)/g of an all-to-all's or a reduce-scatter's input, and (g−1)× an
    all-gather's."""
    out = []
    for (dim, size), group in sorted(_mode_groups(mesh).items()):
        f32 = platform.float32()
        buffer = platform.zeros((max(nbytes // 4 // size * size, size),), dtype=f32)
        piece = platform.zeros((buffer.shape[0] // size,), dtype=f32)
        small, tiny = platform.zeros((size,), dtype=f32), platform.zeros((1,), dtype=f32)
        kinds = {"all_to_all": (lambda t: platform.all_to_all_single(t, group), buffer, small,
                                (size - 1) / size)}
        if dim == "co":
            kinds = {"all_gather": (lambda t: platform.all_gather(t, group), piece, tiny, size - 1),
                     "reduce_scatter": (lambda t: platform.reduce_scatter(t, group), buffer, small,
                                        (size - 1) / size)}
        for kind, (run, large, little, share) in kinds.items():
            latency = _seconds(lambda: run(little))
            full = _seconds(lambda: run(large))
            sent = share * large.shape[0] * 4
            out.append((f"{kind}/{dim}/{size}", max(full - latency, 1e-9) / sent, latency))
    return out


def _kernel(platform, size=256, dim=64):
    q = platform.zeros((1, 4, size, dim), dtype=platform.float32())
    return lambda: platform.sdpa(q, q, q, is_causal=False)


def _compute(platform, mesh, size=256, dim=64):
    """(seconds per flop with every rank computing at once, contention): the kernel's time with
    every rank running it over rank 0's alone while the others wait in a barrier (1 on the other
    ranks; the all-reduce's max keeps rank 0's)."""
    kernel, group = _kernel(platform, size, dim), mesh.get_group(0)
    # about 50 ms a timing, so that the ranks' runs overlap in time despite uneven barrier exits
    repeats = min(max(int(0.05 / max(_seconds(kernel), 1e-6)), 4), 2000)
    platform.barrier(group)
    alone = _seconds(kernel, repeats) if mesh.get_local_rank(0) == 0 and mesh.size() > 1 else None
    platform.barrier(group)
    together = _seconds(kernel, repeats)
    return together / (4 * 4 * size * size * dim), (max(together / alone, 1.0) if alone else 1.0)


def _overlap(platform, group, nbytes):
    """The share of an all-reduce of ``nbytes`` hidden under the kernel run while it travels:
    (compute + transfer − both) / the shorter of the two, in [0, 1]."""
    kernel = _kernel(platform)
    buffer = platform.zeros((max(nbytes // 4, 1),), dtype=platform.float32())
    compute = _seconds(kernel)
    transfer = _seconds(lambda: platform.all_reduce(buffer, group, tag="calibration"))

    def both() -> None:
        handle = platform.all_reduce(buffer, group, async_op=True, tag="calibration")
        kernel()
        handle.wait()
    hidden = (compute + transfer - _seconds(both)) / max(min(compute, transfer), 1e-9)
    return min(max(hidden, 0.0), 1.0)


def _families(cp):
    """(family, fixed-mode keywords) of the modes a ``cp``-rank mesh can run on the tiny input."""
    out = [("ulysses", {}), ("allgather", {"ulysses_degree": 1}),
           ("allgather-lb", {"ulysses_degree": 1, "load_balance": True}),
           ("ring", {"ulysses_degree": 1, "kv_exchange": "ring"}),
           ("ring-zigzag", {"ulysses_degree": 1, "kv_exchange": "ring", "load_balance": True})]
    if cp >= 4 and cp % 2 == 0:
        out += [("hybrid", {"ulysses_degree": 2}),
                ("hybrid-ring", {"ulysses_degree": 2, "kv_exchange": "ring"})]
    return out if cp > 1 else out[:1]


def _mode_seconds(style, mesh):
    """A forward of ``style`` on a tiny input, ×3 for forward + backward (backward costs about twice
    a forward): what the mode costs beyond compute and bytes, which are near zero here. The
    attention is the tuning's stand-in (causal SDPA on BNSD blocks), no module."""
    platform = get_platform()
    q = platform.zeros((1, mesh.size(), 4, 8), dtype=platform.float32())
    # the stand-in's BNSD blocks: the same style with seq_dim 2, head_dim 1
    layout = replace(style.config.layout, seq_dim=2, head_dim=1)
    style = style.from_config(replace(style.config, layout=layout))
    call, cp_mesh = stand_in((2, 1), True, (q, q, q)), style._cp_mesh(mesh)
    return 3 * _seconds(lambda: run_attention(style, cp_mesh, [q, q, q], call))
