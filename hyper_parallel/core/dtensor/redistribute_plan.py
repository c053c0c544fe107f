"""The redistribution planner: a pair of layouts becomes a short list of single collectives."""
from typing import Any, Optional
from dataclasses import dataclass
from enum import Enum

from hyper_parallel.core.dtensor.layout import chunk_range, chunk_sizes, dim_range, shard_orders
from hyper_parallel.core.dtensor.placement_types import HeadTailShard, Partial, Replicate, Shard


class StepKind(str, Enum):
    """What one step does. A str: it equals, hashes and prints as its plain name ("all_gather")."""
    ALL_GATHER = "all_gather"
    ALL_TO_ALL = "all_to_all"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_REDUCE = "all_reduce"
    LOCAL_CHUNK = "local_chunk"
    TO_PARTIAL = "to_partial"

    __str__ = str.__str__
    __hash__ = str.__hash__

    def __format__(self, spec: str) -> str:
        return str.__format__(self, spec)


@dataclass(frozen=True)
class Step:
    kind: StepKind
    mesh_dim: int
    dim: int = -1      # tensor dim gathered / reduced over / chunked
    new_dim: int = -1  # all_to_all: the tensor dim that becomes split
    op: str = "sum"
    sizes: tuple = ()  # chunk sizes of `dim` over the mesh dim's ranks (before the step)
    new_sizes: tuple = ()  # chunk sizes of `new_dim` over the mesh dim's ranks


class RedistributePlanner:
    """Plans ``src`` -> ``dst`` placements of a ``shape`` tensor for the rank at ``coordinate``.

    It works on *shard orders*: per tensor dim, the mesh dims splitting it, innermost last. Every
    step is one collective (or a local op) on one mesh dim, and the phases run in this order:

    0. Local slices that are possible right away (:meth:`_local_slice`), then the all-reduces of
       Partial mesh dims that stay unsharded (:meth:`_reduce`), so later collectives move less.
    1. Shards that must go are taken off innermost first (:meth:`_remove_shards`). A mesh dim that
       moves from Shard(d) to Shard(e) is one all-to-all (:meth:`_shard_to_shard`) when it can
       become the innermost split of e; otherwise target shards that are ready are added first (as
       in 2), and only then is it all-gathered (:meth:`_gather`).
    2. Missing shards are added outermost first (:meth:`_add_shards`): Replicate -> Shard is a local
       slice, Partial -> Shard one reduce-scatter (:meth:`_partial_to_shard`); slices go first.
    3. What is left (:meth:`_replicate_and_partial`): Partial -> Replicate all-reduce, Replicate ->
       Partial local (:meth:`_to_partial`).

    Uneven shards (``torch.chunk`` sizes) are recorded per step so that execution can pad them to
    equal blocks and trim after: every step stays one collective. Each planner plans once; the
    caller (``redistribute._plan``) caches plans per (mesh, coordinate, shape, src, dst).
    """

    def __init__(self, mesh_shape: Any, coordinate: Any, shape: Any, src: Any, dst: Any) -> None:
        self.mesh_shape, self.coordinate, self.shape = mesh_shape, coordinate, shape
        self.src, self.dst = src, dst
        self.orders: Any = None
        self.target: Any = None
        self.state: Optional[list[Any]] = None
        self.steps: list[Any] = []
        # chunking only depends on the kind of shard per mesh dim; HeadTail only appears in dst
        self.chunk_layout = tuple(dst[m] if isinstance(dst[m], HeadTailShard) else Shard(0)
                                  for m in range(len(src)))

    def plan(self) -> Any:
        """The steps, as a tuple."""
        if self.src == self.dst:
            return ()
        self._reject_head_tail()
        ndim = len(self.shape)
        self.orders = shard_orders(self.src, self.mesh_shape, ndim)
        self.target = shard_orders(self.dst, self.mesh_shape, ndim)
        # per mesh dim: its Replicate/Partial placement, or None while it shards a tensor dim
        self.state = [None if p.is_shard() else p for p in self.src]
        self._add_shards(local_only=True)
        self._reduce_unsharded_partials()
        self._remove_shards()
        self._add_shards(local_only=False)
        self._replicate_and_partial()
        return tuple(self.steps)

    def _reject_head_tail(self):
        src, dst = self.src, self.dst
        if any(isinstance(p, HeadTailShard) for p in src) or \
                any(isinstance(p, HeadTailShard) and not src[m].is_replicate() for m, p in enumerate(dst)):
            raise ValueError(f"cannot redistribute {src} -> {dst}: a HeadTailShard (load-balanced half) "
                             f"covers only half the tensor; only Replicate -> HeadTailShard is possible")

    # ------------------------------------------------------------------ phases
    def _reduce_unsharded_partials(self):
        """Phase 0: all-reduce the Partial mesh dims that do not become shards, on the smallest local
        tensor (before any all-gather grows it)."""
        for m, want in enumerate(self.dst):
            if isinstance(self.state[m], Partial) and not want.is_shard() and self.state[m] != want:
                self._reduce(m)

    def _remove_shards(self):
        """Phase 1: take off the shards that are not in the stable prefix, innermost first."""
        while True:
            removable = [(d, self.orders[d][-1]) for d in range(len(self.shape))
                         if len(self.orders[d]) > self._stable_len(d)]
            if not removable:
                return
            if self._move_one_by_all_to_all(removable):
                continue
            # Before gathering, add any target shard that is ready (a slice, or a reduce-scatter of a
            # Partial dim): it never grows the tensor, and it may let the shard move by all-to-all
            # ((P, S(h)) -> (S(s), S(s)): reduce-scatter, then all-to-all; not all-gather first).
            count = len(self.steps)
            self._add_shards(local_only=False)
            if len(self.steps) == count:
                self._gather(*removable[-1])

    def _move_one_by_all_to_all(self, removable):
        for d, m in removable:
            e = self.dst[m].dim if self.dst[m].is_shard() else None
            if e is not None and e != d and self._can_append(e, m):
                self._shard_to_shard(d, m, e)
                return True
        return False

    def _add_shards(self, local_only):
        """Phases 0 and 2: add missing shards, outermost first per tensor dim; local slices before
        reduce-scatters (each slice shrinks what later collectives move). A mesh dim still sharding
        another tensor dim waits for phase 1; ``local_only`` stops before the first reduce-scatter."""
        while True:
            ready = self._ready_shards()
            local = [(e, m) for e, m in ready if not isinstance(self.state[m], Partial)]
            if not local and (local_only or not ready):
                return
            e, m = (local or ready)[0]
            if isinstance(self.state[m], Partial):
                self._partial_to_shard(e, m)
            else:
                self._local_slice(e, m)

    def _ready_shards(self):
        """(tensor dim, mesh dim) pairs whose next target shard can be added now."""
        orders, target = self.orders, self.target
        ready = [(e, target[e][len(orders[e])]) for e in range(len(self.shape))
                 if len(orders[e]) < len(target[e]) and orders[e] == target[e][:len(orders[e])]]
        return [(e, m) for e, m in ready if self.state[m] is not None]

    def _replicate_and_partial(self):
        """Phase 3: the Replicate / Partial conversions that are left."""
        for m, want in enumerate(self.dst):
            have = self.state[m]
            if want.is_shard() or have == want:
                continue
            if isinstance(have, Partial):
                self._reduce(m)
            if isinstance(want, Partial):
                self._to_partial(m, want.reduce_op)

    # ------------------------------------------------------------------ steps
    def _shard_to_shard(self, d, m, e):
        """S(d) -> S(e) on mesh dim m: one all-to-all."""
        self.steps.append(Step(StepKind.ALL_TO_ALL, m, d, e, sizes=self._parent_sizes(d, m),
                               new_sizes=self._sizes(e, m)))
        self.orders[d].pop()
        self.orders[e].append(m)

    def _gather(self, d, m):
        """S(d) -> R on mesh dim m: one all-gather."""
        self.steps.append(Step(StepKind.ALL_GATHER, m, d, sizes=self._parent_sizes(d, m)))
        self.orders[d].pop()
        self.state[m] = Replicate()

    def _partial_to_shard(self, e, m):
        """P -> S(e) on mesh dim m: one reduce-scatter."""
        self.steps.append(Step(StepKind.REDUCE_SCATTER, m, e, op=self.state[m].reduce_op,
                               sizes=self._sizes(e, m)))
        self.orders[e].append(m)
        self.state[m] = None

    def _local_slice(self, e, m):
        """R -> S(e) on mesh dim m: this rank's chunk, no communication."""
        _, size = dim_range(self.shape[e], self.orders[e], self.chunk_layout, self.mesh_shape,
                            self.coordinate)
        index, parts = self.dst[m].chunk_of(self.coordinate[m], self.mesh_shape[m])
        start, length = chunk_range(0, size, parts, index)
        self.steps.append(Step(StepKind.LOCAL_CHUNK, m, e, sizes=(start, length)))
        self.orders[e].append(m)
        self.state[m] = None

    def _reduce(self, m):
        """P -> R on mesh dim m: one all-reduce."""
        self.steps.append(Step(StepKind.ALL_REDUCE, m, op=self.state[m].reduce_op))
        self.state[m] = Replicate()

    def _to_partial(self, m, op):
        """R -> P on mesh dim m: local (ranks other than the first hold the op's identity)."""
        self.steps.append(Step(StepKind.TO_PARTIAL, m, op=op))
        self.state[m] = Partial(op)

    # ------------------------------------------------------------------ shard-order queries
    def _sizes(self, dim, m):
        """Sizes of ``dim``'s current local extent chunked over mesh dim m's ranks."""
        _, size = dim_range(self.shape[dim], self.orders[dim], self.chunk_layout, self.mesh_shape,
                            self.coordinate)
        return tuple(chunk_sizes(size, self.mesh_shape[m]))

    def _parent_sizes(self, dim, m):
        """Sizes of ``dim`` over mesh dim m's ranks, with m the innermost split of ``dim``."""
        _, size = dim_range(self.shape[dim], self.orders[dim][:-1], self.chunk_layout, self.mesh_shape,
                            self.coordinate)
        return tuple(chunk_sizes(size, self.mesh_shape[m]))

    def _stable_len(self, dim):
        """Length of the prefix of ``dim``'s shard order that the target keeps."""
        orders, target, n = self.orders[dim], self.target[dim], 0
        while n < min(len(orders), len(target)) and orders[n] == target[n]:
            n += 1
        return n

    def _can_append(self, dim, m):
        """Whether mesh dim m can become ``dim``'s innermost split now."""
        target = self.target[dim]
        return m in target and self.orders[dim] == target[:target.index(m)]
