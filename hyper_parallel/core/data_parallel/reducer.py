"""The one gradient reducer of data_parallel and fully_shard, on every platform.

A bucket's gradients travel in one flat buffer (``platform.pack_flat``), reduced by one collective:
an all-reduce (data_parallel: every rank gets the whole bucket) or a reduce-scatter (fully_shard:
a [ranks, width] buffer, each rank receiving its row) — :class:`Collective`. Behind each bucket's
gradients ride one presence flag per gradient: a parameter without a gradient on this rank sends
zeros and flag 0, so after the reduction every rank knows exactly whether any rank had one (a
gradient exactly zero everywhere is still a gradient; one no rank computed stays None, as in one
process). The flags are read on the host only where this rank lacked a gradient. Buckets
(:func:`plan_buckets`) hold one dtype and a few MB each, in an order every rank shares, so every
rank issues the same collectives in the same order.

How gradients become ready is the platform's (the contract in platform/training_contract.py):
one by one through per-parameter hooks (torch: :class:`GradientReducer`), or all at once as the
tuple a training step hands its ``grad_reducer`` (MindSpore: :class:`TupleGradReducer`). Both
average (``op="avg"``) or sum (``average=False``) and share ``no_sync`` (checks.py).
fully_shard's units (core/fully_shard/param_group.py, tuple_grads.py) reduce through
:class:`FlatReduction` with ``Collective.REDUCE_SCATTER``.
"""
import enum
import weakref
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Set, Tuple

from hyper_parallel.core.agreement import check_every
from hyper_parallel.core.data_parallel.checks import (Switchable, agree_parameters, backward_count_error,
                                                      check_disjoint_meshes, check_one_dim)
from hyper_parallel.core.dtensor.dtensor import DTensor
from hyper_parallel.platform import get_platform

DEFAULT_BUCKET_MB = 4
BACKWARD_SLOTS = 4   # data_parallel's last bucket carries which backward since the forward, one-hot mod 4


class Collective(enum.Enum):
    """The reduction of a flat gradient buffer."""
    ALL_REDUCE = "all_reduce"           # every rank gets the whole reduced buffer
    REDUCE_SCATTER = "reduce_scatter"   # a [ranks, width] buffer: each rank gets its reduced row


def plan_buckets(entries: Iterable[Tuple[int, Any, int]], cap_bytes: float) -> List[List[int]]:
    """Index lists from ``entries`` ((index, dtype, bytes) in launch order): one dtype each, at most
    ``cap_bytes`` (one tensor may exceed it alone). The order is the caller's, the same on every
    rank, so every rank issues the same collectives."""
    buckets: List[List[int]] = []
    open_by_dtype: Dict[str, int] = {}   # dtype -> index of its open bucket
    sizes: List[int] = []
    for index, dtype, nbytes in entries:
        slot = open_by_dtype.get(str(dtype))
        if slot is None or sizes[slot] + nbytes > cap_bytes:
            slot = len(buckets)
            open_by_dtype[str(dtype)] = slot
            buckets.append([])
            sizes.append(0)
        buckets[slot].append(index)
        sizes[slot] += nbytes
    return buckets


class PendingReduction:
    """One launched flat reduction: ``wait()`` gives this rank's result (payload, flags, tail)."""

    def __init__(self, handle: Any, width: int, present: List[bool], n_flags: int, n_tail: int,
                 op: str, is_async: bool) -> None:
        self.handle, self.width, self.present, self.op = handle, width, present, op
        self.n_flags, self.n_tail, self.is_async = n_flags, n_tail, is_async

    def then_all_reduce(self, group: Any) -> None:
        """HSDP: once the reduce-scatter is done, all-reduce this rank's row over ``group`` (async)."""
        self.handle = get_platform().all_reduce(self.wait(), group, op=self.op, async_op=True)
        self.is_async = True

    def wait(self) -> Any:
        return self.handle.wait() if self.is_async else self.handle

    def payload(self, result: Any, shapes: Sequence[tuple]) -> List[Any]:
        """The reduced gradients of ``result`` in ``shapes`` (views)."""
        return get_platform().unpack_flat(result, shapes)

    def present_anywhere(self, result: Any, wanted: Optional[Sequence[bool]] = None) -> List[bool]:
        """Per gradient: whether any rank had it (the summed flags), among the ``wanted`` ones (default
        all); read on the host only where this rank lacks a wanted one."""
        wanted = [True] * len(self.present) if wanted is None else list(wanted)
        if all(mine or not want for mine, want in zip(self.present, wanted)):
            return [mine and want for mine, want in zip(self.present, wanted)]
        flags = result[self.width:self.width + self.n_flags].tolist()
        return [want and (mine or flag > 0) for mine, want, flag in zip(self.present, wanted, flags)]

    def tail_values(self, result: Any) -> List[float]:
        """The values sent after the flags (reduced): data_parallel's backward count."""
        total = self.width + self.n_flags + self.n_tail
        return result[self.width + self.n_flags:total].tolist()


class FlatReduction:
    """The collective of one flat gradient buffer: ``collective`` over ``group`` with ``op`` ("avg"
    or "sum"); ``tag`` names it in communication accounting; ``async_op=False`` reduces at once."""

    def __init__(self, collective: Collective, group: Any, op: str, tag: Optional[str] = None,
                 async_op: bool = True) -> None:
        self.collective, self.group, self.op, self.tag, self.async_op = collective, group, op, tag, async_op

    def launch(self, grads: Sequence[Any], zeros: Callable[[int], Any] = lambda i: None,
               flags: bool = True, tail: Sequence[float] = ()) -> PendingReduction:
        """All-reduce ``grads`` (None: none on this rank; ``zeros(i)`` is sent, given by callers whose
        gradients may be missing) packed with one presence flag each (``flags``) and ``tail``."""
        platform = get_platform()
        present = [g is not None for g in grads]
        values = [g if g is not None else zeros(i) for i, g in enumerate(grads)]
        marks = [1.0 if mine else 0.0 for mine in present] if flags else []
        flat = platform.pack_flat(values, marks + list(tail))
        width = sum(int(v.numel()) for v in values)
        return self._start(flat, width, present, len(marks), len(tail))

    def launch_rows(self, rows: int, width: int, present: List[bool], dtype: Any, device: Any,
                    fill: Callable[[Any], None]) -> PendingReduction:
        """Reduce a [rows, width + one flag per gradient] buffer: ``fill(buffer2d)`` writes the payload
        columns (zeros where ``present`` is False), the flag columns are written here."""
        platform = get_platform()
        n_flags = len(present)
        # not zero-filled: the caller writes every payload column it reads back
        flat = platform.empty((rows * (width + n_flags),), dtype=dtype, device=device)
        flat2d = flat.view(rows, width + n_flags)
        flags = flat2d[:, width:]
        flags.zero_()
        fill(flat2d)
        for i, mine in enumerate(present):
            if mine:
                flags[:, i] = 1
        return self._start(flat, width, present, n_flags, 0)

    def reduce_flat(self, flat: Any, then_group: Optional[Any] = None) -> Any:
        """``flat`` reduced now (a reduction made with ``async_op=False``), no flags (every rank has
        every gradient), then all-reduced over ``then_group`` (HSDP's replicas) if given."""
        result = self._start(flat, int(flat.numel()), [], 0, 0).wait()
        if then_group is None:
            return result
        return get_platform().all_reduce(result, then_group, op=self.op)

    def _start(self, flat: Any, width: int, present: List[bool], n_flags: int,
               n_tail: int) -> PendingReduction:
        platform = get_platform()
        if self.collective is Collective.ALL_REDUCE:
            handle = platform.all_reduce(flat, self.group, op=self.op, async_op=self.async_op, tag=self.tag)
        else:
            handle = platform.reduce_scatter(flat, self.group, 0, op=self.op, async_op=self.async_op)
        return PendingReduction(handle, width, present, n_flags, n_tail, self.op, self.async_op)


class _Bucket:
    def __init__(self, params: list) -> None:
        self.params = params
        self.ready: Set[int] = set()


class GradientReducer(Switchable):
    """The hooks data_parallel installs where gradients become ready one by one (torch);
    ``module._hp_grad_reducer`` after wrapping.

    State changed after wrapping (SPEC §19): each forward of the module compares its trainable
    parameters with the ones the buckets were built for and rebuilds them on a change (a parameter
    frozen, unfrozen or added); a change and the first forward are checked across the ranks. Each
    backward's gradient is reduced exactly once: a ``.grad`` this reducer wrote (already reduced)
    is set aside when the next backward delivers a new gradient and added back after the
    reduction, so two ``backward()`` calls without ``no_sync`` give one process's accumulated
    gradient under ``average=False`` too. Each reduction carries which backward since the last
    forward it is: ranks that ran different numbers of backward passes get a ValueError."""

    def __init__(self, module: Any, device_mesh: Any, average: bool, bucket_mb: float) -> None:
        check_one_dim(device_mesh)
        self.platform = get_platform()
        self.module = module
        self.mesh = device_mesh
        self.reduction = FlatReduction(Collective.ALL_REDUCE, device_mesh.get_group(),
                                       "avg" if average else "sum", tag="dp_all_reduce")
        self.enabled = True
        self.cap_bytes = bucket_mb * 2 ** 20
        self.remove: Optional[Callable[[], None]] = None
        self.params: List[Any] = []
        self._written: Dict[int, Any] = {}   # id(param) -> weak reference to the reduced .grad it wrote
        self._carry: Dict[int, Any] = {}     # id(param) -> an already-reduced .grad set aside
        self._backwards = 0    # backward passes since the module's last forward
        self._verified = False
        self._build(self._trainable())
        self.platform.register_forward_pre_hook(module, self._pre_forward)

    def _trainable(self) -> list:
        named = self.platform.named_parameters(self.module, recurse=True)
        return [(n, p) for n, p in named if p.requires_grad]

    def _build(self, named: list) -> None:
        for name, param in named:
            check_disjoint_meshes(param, self.mesh, name)
        if self.remove is not None:
            self.remove()
        self.params = [p for _, p in named]
        # reverse registration order is roughly the order backward produces the gradients (the last
        # layers first), so early buckets complete early
        order = list(reversed(self.params))
        entries = [(i, p.dtype, self.platform.tensor_nbytes(_local(p))) for i, p in enumerate(order)]
        self.buckets = [_Bucket([order[i] for i in b]) for b in plan_buckets(entries, self.cap_bytes)]
        self.bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self._reset()
        remove_ready = self.platform.register_grad_ready_hooks(self.params, self._on_ready,
                                                               self._on_backward_end)
        arrivals = [self.platform.register_grad_arrival_hook(p, self._on_arrival) for p in self.params]

        def remove():
            remove_ready()
            for handle in arrivals:
                handle.remove()
        self.remove = remove

    def _pre_forward(self, module: Any, args: tuple) -> None:
        self._backwards = 0
        named = self._trainable()
        changed = (len(named) != len(self.params)
                   or any(p is not q for (_, p), q in zip(named, self.params)))
        if changed:   # frozen, unfrozen or added since wrapping (or the last forward)
            self._build(named)
        if changed or not self._verified or check_every():
            agree_parameters(self.mesh, named, self)
            self._verified = True

    def _reset(self) -> None:
        for bucket in self.buckets:
            bucket.ready = set()
        self.next_launch = 0
        self.pending: List[Tuple[_Bucket, PendingReduction]] = []

    # ------------------------------------------------------------------ hooks
    def _is_written(self, param: Any) -> bool:
        """``param.grad`` is the reduced gradient this reducer wrote (nothing added since)."""
        ref = self._written.get(id(param))
        return ref is not None and param.grad is not None and ref() is param.grad

    def _on_arrival(self, param: Any) -> None:
        """A new gradient is about to be added to ``param.grad``: an already-reduced one is set
        aside, so that only this backward's gradient is reduced (it is added back after)."""
        if self._is_written(param):
            self._carry[id(param)] = param.grad
            param.grad = None
        self._written.pop(id(param), None)

    def _on_ready(self, param: Any) -> None:
        if not self.enabled:
            return
        bucket = self.bucket_of[id(param)]
        if id(param) in bucket.ready:
            # readied twice before the end of a backward: the previous backward raised midway
            for _, pending in self.pending:
                pending.wait()
            self._reset()
        bucket.ready.add(id(param))
        while self.next_launch < len(self.buckets):   # strictly in order: the same on every rank
            bucket = self.buckets[self.next_launch]
            if len(bucket.ready) < len(bucket.params):
                return
            self._launch(bucket)

    def _on_backward_end(self) -> None:
        if not self.enabled:
            return
        try:
            while self.next_launch < len(self.buckets):  # buckets with unused parameters
                self._launch(self.buckets[self.next_launch])
            counts = set()
            for bucket, pending in self.pending:
                counts |= self._write_back(bucket, pending)
        finally:
            self._reset()
            self._backwards += 1
        if len(counts) > 1:
            raise ValueError(backward_count_error(self._backwards, self.mesh))

    # ------------------------------------------------------------------ one bucket
    def _launch(self, bucket: _Bucket) -> None:
        # the last bucket also carries which backward since the forward this is
        tail = [1.0 if self._backwards % BACKWARD_SLOTS == k else 0.0 for k in range(BACKWARD_SLOTS)] \
            if bucket is self.buckets[-1] else []
        grads = [self._local_grad(p) for p in bucket.params]
        self.pending.append((bucket, self.reduction.launch(grads, lambda i: _zeros(bucket.params[i]),
                                                           tail=tail)))
        self.next_launch += 1

    def _local_grad(self, param: Any) -> Any:
        """This backward's local gradient of ``param``, or None (unused here, or only the reduced
        gradient of an earlier backward, which is not reduced again)."""
        if param.grad is None or self._is_written(param):
            return None
        return _local(param.grad)

    def _write_back(self, bucket: _Bucket, pending: PendingReduction) -> set:
        """The reduced bucket into ``.grad`` (plus what was set aside); returns the backward-count
        slots any rank set (one on agreeing ranks)."""
        flat = pending.wait()
        reduced = pending.payload(flat, [tuple(_local(p).shape) for p in bucket.params])
        anywhere = None
        for i, param in enumerate(bucket.params):
            if pending.present[i]:
                _local(param.grad).copy_(reduced[i])
            else:
                if anywhere is None:
                    anywhere = pending.present_anywhere(flat)
                # used on another rank only: take its gradient; never give an everywhere-unused
                # parameter a zero gradient (optimizers would still step it)
                if anywhere[i]:
                    _add_reduced(param, reduced[i])
            carry = self._carry.pop(id(param), None)
            if carry is not None:
                if param.grad is None:
                    param.grad = carry
                else:
                    _local(param.grad).add_(_local(carry))
            if param.grad is not None:
                self._written[id(param)] = weakref.ref(param.grad)
        if not pending.n_tail or self.platform.is_fake(flat):   # no tail, or no values (a dry run)
            return set()
        return {k for k, value in enumerate(pending.tail_values(flat)) if value > 0}


def _add_reduced(param: Any, reduced: Any) -> None:
    """``param.grad`` (None, or an earlier backward's reduced gradient) plus ``reduced``."""
    if param.grad is not None:
        _local(param.grad).add_(reduced)
        return
    param.grad = reduced if not isinstance(param, DTensor) else DTensor.from_local(
        reduced, param.device_mesh, param.placements, shape=param.shape)


def _zeros(param: Any) -> Any:
    local = _local(param)
    return get_platform().zeros(tuple(local.shape), dtype=local.dtype, device=local.device)


def _local(tensor: Any) -> Any:
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor
