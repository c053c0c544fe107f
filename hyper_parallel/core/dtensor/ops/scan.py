"""cumsum: a scan along ``dim``, exact across ranks with a prefix offset.

A scan along a dim no mesh dim splits is local. Along a dim split by exactly one mesh dim with a
plain Shard, each rank scans its own piece and adds the totals of the pieces before it: one small
all-gather of the piece totals (differentiable: its backward is a reduce-scatter), and the output
stays sharded. An empty (uneven) piece has a zero total. Nested or strided splits of the dim are
gathered instead. cumsum is linear, so a Partial(sum / avg) input stays Partial; other Partials are
reduced first. (docs/dtensor.md walks through this rule as its worked example.)
"""
from typing import Any
from hyper_parallel.core.dtensor.ops.registry import OpStrategy, register_rule
from hyper_parallel.core.dtensor.placement_types import Replicate, Shard
from hyper_parallel.platform import get_platform


@register_rule("cumsum")
def cumsum_rule(call: Any) -> Any:
    x = call.arg(0, "input")
    spec = call.spec(x)
    dim = call.arg(1, "dim")
    if spec is None or call.index(x) != 0 or spec.ndim == 0 or not isinstance(dim, int) \
            or isinstance(dim, bool):
        return None
    dim %= spec.ndim
    scan = [m for m, p in enumerate(spec.placements) if p.is_shard(dim)]
    if len(scan) != 1 or type(spec.placements[scan[0]]) is not Shard:
        scan = []
    placements: list[Any] = []
    for m, p in enumerate(spec.placements):
        if p.is_shard(dim) and m not in scan:
            p = Replicate()                            # gather this split of `dim`
        elif p.is_partial() and p.reduce_op not in ("sum", "avg"):
            p = Replicate()
        placements.append(p)
    placements_t = tuple(placements)
    local = _scan_across(call.mesh, scan[0], dim) if scan else None
    return OpStrategy(inputs=[placements_t], outputs=placements_t, local=local)


def _scan_across(mesh, mesh_dim, dim):
    platform = get_platform()

    def scan_with_prefix(call, args, kwargs):
        piece = args[0] if args else kwargs["input"]
        out = call.func(*args, **kwargs)               # the scan of this rank's piece
        # platform.local_sum: MindSpore leaves the sum of an empty (uneven) piece uninitialised
        total = platform.local_sum(piece, dim=dim, keepdim=True).to(out.dtype)
        totals = platform.differentiable_all_gather(total.contiguous(), mesh.get_group(mesh_dim), dim)
        before = mesh.get_local_rank(mesh_dim)
        return out + platform.local_sum(totals.narrow(dim, 0, before), dim=dim, keepdim=True)
    return scan_with_prefix


__all__ = ["cumsum_rule"]
