"""How a tensor is laid out over one mesh dimension.

``Shard(d)``: split along tensor dim d (``torch.chunk`` sizes). ``StridedShard(d, k)``: a Shard
applied *after* the later mesh dims (of total size k) that split the same tensor dim, as when CP
splits heads that TP split first. ``Replicate()``: every rank holds it all. ``Partial(op)``: the
value is the reduction (sum/avg/max/min) of the ranks' local tensors.
"""
from typing import Any
from hyper_parallel.core.arguments import check_int

REDUCE_OPS = ("sum", "avg", "max", "min")


class Placement:
    __slots__ = ()

    def is_shard(self, dim: Any = None) -> bool:
        return False

    def is_replicate(self) -> bool:
        return False

    def is_partial(self) -> bool:
        return False

    def normalized(self, ndim: Any) -> Any:
        """The same placement with a non-negative tensor dim."""
        return self


class Shard(Placement):
    __slots__ = ("dim",)

    def __init__(self, dim: Any) -> None:
        self.dim = check_int("Shard", "dim", dim, fix="the int tensor dim to split")

    def is_shard(self, dim: Any = None) -> bool:
        return dim is None or dim == self.dim

    def with_dim(self, dim: Any) -> Any:
        """The same kind of shard on another tensor dim."""
        return Shard(dim)

    def chunk_of(self, coordinate: Any, mesh_size: Any) -> Any:
        """(chunk index, number of chunks) that the rank at ``coordinate`` holds."""
        return coordinate, mesh_size

    def normalized(self, ndim: Any) -> Any:
        dim = self.dim + ndim if self.dim < 0 else self.dim
        if not 0 <= dim < max(ndim, 1):
            raise ValueError(f"{self!r} is out of range for a tensor of {ndim} dims")
        return self.with_dim(dim) if dim != self.dim else self

    def __eq__(self, other):
        return type(other) is Shard and other.dim == self.dim

    def __hash__(self):
        return hash(("S", self.dim))

    def __repr__(self):
        return f"S({self.dim})"


class StridedShard(Shard):
    __slots__ = ("split_factor",)

    def __init__(self, dim: Any, split_factor: Any) -> None:
        super().__init__(dim)
        self.split_factor = check_int("StridedShard", "split_factor", split_factor, minimum=1,
                                      fix="the positive int size of the later mesh dims that split the dim")

    def with_dim(self, dim: Any) -> Any:
        return StridedShard(dim, self.split_factor)

    def __eq__(self, other):
        return (type(other) is StridedShard
                and (other.dim, other.split_factor) == (self.dim, self.split_factor))

    def __hash__(self):
        return hash(("SS", self.dim, self.split_factor))

    def __repr__(self):
        return f"SS({self.dim},{self.split_factor})"


class HeadTailShard(Shard):
    """Internal layout of causal load balancing. The sequence is cut into ``2n`` equal chunks; the
    rank at coordinate r owns chunks 2r and 2r+1 (its contiguous block) and, paired with rank
    n-1-r, swaps its second chunk for that rank's: it computes chunk 2r (``half=0``, the head) and
    chunk 2n-1-2r (``half=1``, the tail). Each pair's causal work sums to the same 2n+1 chunk
    blocks, and each rank sends one half of its block. The pieces of one half cover only half the
    tensor, so such a DTensor is never redistributed; it only flows through ops."""
    __slots__ = ("half",)

    def __init__(self, dim: Any, half: Any) -> None:
        super().__init__(dim)
        if half not in (0, 1):
            raise ValueError(f"HeadTailShard half must be 0 or 1, got {half!r}")
        self.half = half

    def with_dim(self, dim: Any) -> Any:
        return HeadTailShard(dim, self.half)

    def chunk_of(self, coordinate: Any, mesh_size: Any) -> Any:
        return (2 * coordinate if self.half == 0 else 2 * mesh_size - 1 - 2 * coordinate), 2 * mesh_size

    def __eq__(self, other):
        return type(other) is HeadTailShard and (other.dim, other.half) == (self.dim, self.half)

    def __hash__(self):
        return hash(("HT", self.dim, self.half))

    def __repr__(self):
        return f"HT({self.dim},{'head' if self.half == 0 else 'tail'})"


class Replicate(Placement):
    __slots__ = ()

    def is_replicate(self) -> bool:
        return True

    def __eq__(self, other):
        return type(other) is Replicate

    def __hash__(self):
        return hash("R")

    def __repr__(self):
        return "R"


class Partial(Placement):
    __slots__ = ("reduce_op",)

    def __init__(self, reduce_op: str = "sum") -> None:
        if reduce_op not in REDUCE_OPS:
            raise ValueError(f"Partial reduce_op {reduce_op!r} is not one of {REDUCE_OPS}")
        self.reduce_op = reduce_op

    def is_partial(self) -> bool:
        return True

    def __eq__(self, other):
        return type(other) is Partial and other.reduce_op == self.reduce_op

    def __hash__(self):
        return hash(("P", self.reduce_op))

    def __repr__(self):
        return f"P({self.reduce_op})"


def normalize_placements(placements: Any, ndim: Any, mesh_ndim: Any) -> Any:
    placements = tuple(placements)
    if len(placements) != mesh_ndim:
        raise ValueError(f"got {len(placements)} placements {placements} for a {mesh_ndim}-D mesh; "
                         f"give exactly one placement per mesh dim")
    for p in placements:
        if not isinstance(p, Placement):
            raise ValueError(f"{p!r} is not a placement; use Shard(d), Replicate() or Partial()")
    return tuple(p.normalized(ndim) for p in placements)
