"""Kernels that refuse an empty piece (reflection / replication padding, some upsampling and
pooling kernels raise on a zero-size batch): a rule for them gathers a split that would leave some
rank an empty piece, so that every rank runs the kernel on data (one rank raising alone would leave
the others waiting in the next collective)."""
from typing import Any
from hyper_parallel.core.dtensor.ops.reductions import _any_empty
from hyper_parallel.core.dtensor.placement_types import Replicate


def without_empty_pieces(spec: Any, placements: Any) -> Any:
    """``placements`` (for ``spec``'s tensor), every shard replicated if any rank's piece of a split
    dim would be empty under them. The same answer on every rank (all coordinates are checked)."""
    dims = tuple(sorted({p.dim for p in placements if p.is_shard()}))
    if dims and _any_empty(tuple(spec.shape), tuple(placements), tuple(spec.mesh.mesh_shape), dims):
        return tuple(Replicate() if p.is_shard() else p for p in placements)
    return tuple(placements)


__all__ = ["without_empty_pieces"]
