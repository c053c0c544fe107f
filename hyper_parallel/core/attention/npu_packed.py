"""``npu_fusion_attention`` in TND layout with query, key and value all split along T: data
parallelism over packed sequences.

Each rank holds a contiguous range of the packed tokens of q and of k/v. That equals the
single-device call only when every range holds whole sequences, and the same sequences for q and
for k/v (sequence i's queries and keys on the same rank); then each rank calls the kernel on its
own tokens with ``actual_seq_qlen`` / ``actual_seq_kvlen`` rebased to its range (the ends inside
the range, minus its start). A range that cuts a sequence would silently drop the keys on the
other rank, so it is a ValueError, checked for every rank's range (all ranks raise alike).
"""
from typing import Any
import itertools

from hyper_parallel.core.dtensor.layout import local_box
from hyper_parallel.core.attention.npu_args import as_int_list, packed_sequence_ends


def packed_split(geo: Any, specs: Any) -> bool:
    """True when q, k and v are all split along T by the same mesh dims (TND only)."""
    if geo.layout != "TND":
        return False
    splits = [tuple(m for m, p in enumerate(s.placements) if p.is_shard(geo.seq)) for s in specs]
    return bool(splits[0]) and splits[0] == splits[1] == splits[2]


def _index_of(ends, position):
    """How many sequences end at or before ``position``, or None if it is inside a sequence."""
    bounds = [0] + list(ends)
    for i, b in enumerate(bounds):
        if b == position:
            # the last of equal bounds: empty sequences at a cut belong to the earlier rank
            while i + 1 < len(bounds) and bounds[i + 1] == position:
                i += 1
            return i
    return None


def check_packed_split(a: Any, geo: Any, mesh: Any, specs: Any) -> None:
    """ValueError unless every rank's T range of q and of k/v holds the same whole sequences."""
    cq, ckv = packed_sequence_ends(a, geo)
    qs, ks, _ = specs
    for coordinate in itertools.product(*(range(n) for n in mesh.mesh_shape)):
        q0, ql = local_box(qs.shape, qs.placements, mesh.mesh_shape, coordinate)[geo.seq]
        k0, kl = local_box(ks.shape, ks.placements, mesh.mesh_shape, coordinate)[geo.seq]
        first = (_index_of(cq, q0), _index_of(ckv, k0))
        last = (_index_of(cq, q0 + ql), _index_of(ckv, k0 + kl))
        if None in first + last or first[0] != first[1] or last[0] != last[1]:
            raise ValueError(
                f"npu_fusion_attention: q, k and v are all split along T (packed sequences as data "
                f"parallelism), but the rank at mesh coordinate {coordinate} holds query tokens "
                f"[{q0}, {q0 + ql}) and key tokens [{k0}, {k0 + kl}), which are not the same whole "
                f"sequences (actual_seq_qlen {cq}, actual_seq_kvlen {ckv}); pack whole sequences per "
                f"rank (pad them to the split), or split only the queries (all-gather K/V / "
                f"ContextParallel)")


def local_packed_lengths(a: Any, q_range: Any, kv_range: Any) -> Any:
    """actual_seq_qlen / actual_seq_kvlen of this rank's tokens: the ends inside its range, rebased."""
    (q0, ql), k0 = q_range, kv_range[0]
    cq, ckv = as_int_list(a["actual_seq_qlen"]), as_int_list(a["actual_seq_kvlen"])
    first, last = _index_of(cq, q0), _index_of(cq, q0 + ql)
    return {"actual_seq_qlen": [e - q0 for e in cq[first:last]],
            "actual_seq_kvlen": [e - k0 for e in ckv[first:last]]}


__all__ = ["check_packed_split", "local_packed_lengths", "packed_split"]
