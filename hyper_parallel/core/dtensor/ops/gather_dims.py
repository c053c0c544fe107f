"""gather_dims: the layout of an op that needs some tensor dims whole on every rank.

Shared by the ops that gather the dims they work along (whole_dim.py: argmax, sort, ...; slicing.py:
split, narrow, indexing; vector_norm.py's inf norms) and keep every other shard, moved to where its
dim lands in the output.
"""
from typing import Any
from hyper_parallel.core.dtensor.placement_types import Replicate


def gather_dims(spec: Any, dims: Any, out_dim_of: Any, partial_stays: bool = False) -> Any:
    """(input placements, output placements): shards of ``dims`` are replicated; other shards kept
    and moved by ``out_dim_of`` (input dim -> output dim). A Partial is reduced first, unless
    ``partial_stays`` (an op that only moves data, so a pending sum / max passes through it)."""
    inputs, outputs = [], []
    for p in spec.placements:
        if (p.is_shard() and p.dim in dims) or (p.is_partial() and not partial_stays):
            inputs.append(Replicate())
            outputs.append(Replicate())
        elif p.is_shard():
            inputs.append(p)
            outputs.append(p.with_dim(out_dim_of(p.dim)))
        else:
            inputs.append(p)
            outputs.append(p)
    return tuple(inputs), tuple(outputs)


__all__ = ["gather_dims"]
