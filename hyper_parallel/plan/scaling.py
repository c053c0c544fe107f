"""A big model's dry run from two small ones: run the model with k and 2k decoder layers (k = one period
of its layer pattern: 1 for Llama, 2 for gpt-oss's sliding/full pair, 4 for Qwen3-Next's 3 linear + 1
full, 6 for Gemma 3) and extend every per-rank quantity linearly to the model's L layers:
x(L) = x(k) + (L - k) / k * (x(2k) - x(k)). Exact for what grows by whole layers (parameters,
gradients, optimizer state, saved activations, FLOPs, fully_shard's per-layer collectives); the
peak is the peak of a stack of identical layers, which is linear in L once the layer count passes
the prefetch depth (two units). What a layer count changes otherwise (DeepSeek-V3's first three
dense layers are cut to k - 1) is an approximation.
"""
import collections
import dataclasses
from typing import Any, Callable

from hyper_parallel.plan.report import DryRunReport


def _line(a: float, b: float, t: float) -> float:
    return a + t * (b - a)


def _comm(small: dict, large: dict, t: float) -> dict:
    out: dict[str, Any] = {}
    for label in set(small) | set(large):
        empty = {"collectives": 0, "bytes_sent": 0, "bytes_received": 0, "ops": {}}
        a, b = small.get(label, empty), large.get(label, empty)
        ops: dict[Any, tuple[int, ...]] = {}
        for op in set(a["ops"]) | set(b["ops"]):
            pairs = zip(a["ops"].get(op, (0, 0)), b["ops"].get(op, (0, 0)))
            ops[op] = tuple(int(round(_line(x, y, t))) for x, y in pairs)
        out[label] = {k: int(round(_line(a[k], b[k], t)))
                      for k in ("collectives", "bytes_sent", "bytes_received")}
        out[label]["ops"] = ops
    return out


def extrapolate(small: DryRunReport, large: DryRunReport, k: int, layers: int) -> DryRunReport:
    """The report of ``layers`` layers from those of k (``small``) and 2k (``large``) layers."""
    t = (layers - k) / k
    ops: Any = collections.Counter()
    for key in set(small.ops) | set(large.ops):
        ops[key] = max(0.0, _line(small.ops.get(key, 0), large.ops.get(key, 0), t))
    memory = {c: int(round(_line(small.memory_bytes[c], large.memory_bytes[c], t)))
              for c in small.memory_bytes}
    return dataclasses.replace(
        small, memory_bytes=memory, peak_memory_bytes=int(round(_line(small.peak_memory_bytes,
                                                                      large.peak_memory_bytes, t))),
        flops=int(round(_line(small.flops, large.flops, t))), comm=_comm(small.comm, large.comm, t),
        memory_bound_bytes=int(round(_line(small.memory_bound_bytes, large.memory_bound_bytes, t))),
        op_count=int(round(_line(small.op_count, large.op_count, t))),
        ops=dict(ops), layers=(k, layers), wall_seconds=small.wall_seconds + large.wall_seconds)


def scaled_dry_run(run: Callable[[int], DryRunReport], k: int, layers: int) -> DryRunReport:
    """``run(n)`` dry-runs the model cut to n layers; whole model when it is no longer than 2k."""
    if layers <= 2 * k:
        return run(layers)
    return extrapolate(run(k), run(2 * k), k, layers)
