"""data_parallel(module, mesh): all-reduce every parameter gradient over a data-parallel mesh.

The contract and its use in a training step: docs/training.md.

The mesh is whatever set of ranks saw different tokens for the same parameters: a "dp" mesh, the
"cp" mesh (each context-parallel rank sees only its sequence block), or a flattened dp×cp mesh.

Gradients are reduced in buckets of a few MB (same-dtype gradients flattened into one tensor, one
collective each) launched asynchronously as soon as backward has produced every gradient of a
bucket, so communication overlaps the rest of backward; the end-of-backward callback waits for all
of them and writes the results back into ``.grad``. Buckets are launched strictly in their fixed
order, so every rank issues the same collectives in the same order even when ranks produce
gradients in different orders (or leave some parameters unused).

DTensor parameters (tensor parallel) reduce their local gradient: their shards are different
tensors on different TP ranks, the same tensor on different DP ranks, so the DP mesh must not share
a rank with the DTensor's own mesh.
"""
from hyper_parallel.core.arguments import check_float
import weakref

from hyper_parallel.core.agreement import check_every
from hyper_parallel.core.data_parallel_checks import (Switchable, agree_parameters, backward_count_error,
                                                      check_disjoint_meshes, check_one_dim)
from hyper_parallel.core.data_parallel_tuple import tuple_data_parallel
from hyper_parallel.core.dtensor.dtensor import DTensor
from hyper_parallel.platform import get_platform

DEFAULT_BUCKET_MB = 4


class _Bucket:
    def __init__(self, dtype):
        self.dtype = dtype
        self.params = []
        self.nbytes = 0
        self.ready = set()

    def add(self, param, nbytes):
        self.params.append(param)
        self.nbytes += nbytes


class GradientReducer(Switchable):
    """The hooks data_parallel installs; ``module._hp_grad_reducer`` after wrapping.

    State changed after wrapping (SPEC §19): each forward of the module compares its trainable
    parameters with the ones the buckets were built for and rebuilds them on a change (a parameter
    frozen, unfrozen or added); a change and the first forward are checked across the ranks. Each
    backward's gradient is reduced exactly once: a ``.grad`` this reducer wrote (already reduced)
    is set aside when the next backward delivers a new gradient and added back after the
    reduction, so two ``backward()`` calls without ``no_sync`` give one process's accumulated
    gradient under ``average=False`` too. Each reduction carries which backward since the last
    forward it is: ranks that ran different numbers of backward passes get a ValueError."""

    def __init__(self, module, device_mesh, average, bucket_mb):
        check_one_dim(device_mesh)
        self.platform = get_platform()
        self.module = module
        self.mesh = device_mesh
        self.group = device_mesh.get_group()
        self.op = "avg" if average else "sum"
        self.enabled = True
        self.cap_bytes = bucket_mb * 2 ** 20
        self.remove, self.params = None, []
        self._written = {}     # id(param) -> weak reference to the reduced .grad this reducer wrote
        self._carry = {}       # id(param) -> an already-reduced .grad set aside for this backward
        self._backwards = 0    # backward passes since the module's last forward
        self._verified = False
        self._build(self._trainable())
        self.platform.register_forward_pre_hook(module, self._pre_forward)

    def _trainable(self):
        named = self.platform.named_parameters(self.module, recurse=True)
        return [(n, p) for n, p in named if p.requires_grad]

    def _build(self, named):
        for name, param in named:
            check_disjoint_meshes(param, self.mesh, name)
        if self.remove is not None:
            self.remove()
        self.params = [p for _, p in named]
        self.buckets = self._make_buckets(self.params, self.cap_bytes)
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

    def _pre_forward(self, module, args):
        self._backwards = 0
        named = self._trainable()
        changed = (len(named) != len(self.params)
                   or any(p is not q for (_, p), q in zip(named, self.params)))
        if changed:   # frozen, unfrozen or added since wrapping (or the last forward)
            self._build(named)
        if changed or not self._verified or check_every():
            agree_parameters(self.mesh, named, self)
            self._verified = True

    @staticmethod
    def _make_buckets(params, cap_bytes):
        """Buckets in reverse registration order, which is roughly the order backward produces the
        gradients (the last layers first), so early buckets complete early."""
        buckets, open_by_dtype = [], {}
        for p in reversed(params):
            local = p._local_tensor if isinstance(p, DTensor) else p
            nbytes = local.numel() * local.element_size()
            bucket = open_by_dtype.get(p.dtype)
            if bucket is None or (bucket.params and bucket.nbytes + nbytes > cap_bytes):
                bucket = _Bucket(p.dtype)
                open_by_dtype[p.dtype] = bucket
                buckets.append(bucket)
            bucket.add(p, nbytes)
        return buckets

    def _reset(self):
        for bucket in self.buckets:
            bucket.ready = set()
        self.next_launch = 0
        self.pending = []

    # ------------------------------------------------------------------ hooks
    def _is_written(self, param):
        """``param.grad`` is the reduced gradient this reducer wrote (nothing added since)."""
        ref = self._written.get(id(param))
        return ref is not None and param.grad is not None and ref() is param.grad

    def _on_arrival(self, param):
        """A new gradient is about to be added to ``param.grad``: an already-reduced one is set
        aside, so that only this backward's gradient is reduced (it is added back after)."""
        if self._is_written(param):
            self._carry[id(param)] = param.grad
            param.grad = None
        self._written.pop(id(param), None)

    def _on_ready(self, param):
        if not self.enabled:
            return
        bucket = self.bucket_of[id(param)]
        if id(param) in bucket.ready:
            # readied twice before the end of a backward: the previous backward raised midway
            self._drain()
            self._reset()
        bucket.ready.add(id(param))
        self._launch_ready()

    def _launch_ready(self):
        while self.next_launch < len(self.buckets):
            bucket = self.buckets[self.next_launch]
            if len(bucket.ready) < len(bucket.params):
                return
            self._launch(bucket)

    def _on_backward_end(self):
        if not self.enabled:
            return
        try:
            while self.next_launch < len(self.buckets):  # buckets with unused parameters
                self._launch(self.buckets[self.next_launch])
            counts = set()
            for bucket, grads, handle in self.pending:
                counts |= self._write_back(bucket, grads, handle.wait())
        finally:
            self._reset()
            self._backwards += 1
        if len(counts) > 1:
            raise ValueError(backward_count_error(self._backwards, self.mesh))

    def _drain(self):
        for _, _, handle in self.pending:
            handle.wait()

    # ------------------------------------------------------------------ one bucket
    def _launch(self, bucket):
        grads = [self._local_grad(p) for p in bucket.params]
        # one presence flag per parameter rides along: whether any rank computed its gradient is
        # then known exactly (a gradient that is exactly zero everywhere is still a gradient); the
        # last bucket also carries which backward since the forward this is (one-hot, mod 4)
        present = [0.0 if g is None else 1.0 for g in grads]
        if bucket is self.buckets[-1]:
            present += [1.0 if self._backwards % 4 == k else 0.0 for k in range(4)]
        grads = [self._zeros(p) if g is None else g for p, g in zip(bucket.params, grads)]
        flags = self.platform.tensor(present, dtype=grads[0].dtype, device=grads[0].device)
        flat = self.platform.cat([g.reshape(-1) for g in grads] + [flags], 0)
        handle = self.platform.all_reduce(flat, self.group, op=self.op, async_op=True, tag="dp_all_reduce")
        self.pending.append((bucket, present, handle))
        self.next_launch += 1

    def _local_grad(self, param):
        """This backward's local gradient of ``param``, or None (unused here, or only the reduced
        gradient of an earlier backward, which is not reduced again)."""
        if param.grad is None or self._is_written(param):
            return None
        return _local(param.grad)

    @staticmethod
    def _zeros(param):
        local = _local(param)
        return get_platform().zeros(tuple(local.shape), dtype=local.dtype, device=local.device)

    def _write_back(self, bucket, present, flat):
        """The reduced bucket into ``.grad`` (plus what was set aside); returns the backward-count
        slots any rank set (one on agreeing ranks)."""
        offset, n_params, flags = 0, len(bucket.params), None
        for i, param in enumerate(bucket.params):
            local = _local(param)
            n = local.numel()
            reduced = flat[offset:offset + n].reshape(tuple(local.shape))
            offset += n
            if present[i]:
                _local(param.grad).copy_(reduced)
            else:
                if flags is None:   # read on the host only where this rank lacks a gradient
                    flags = flat[flat.shape[0] - len(present):].tolist()
                # used on another rank only: take its gradient; never give an everywhere-unused
                # parameter a zero gradient (optimizers would still step it)
                if flags[i] > 0:
                    self._add_reduced(param, reduced)
            carry = self._carry.pop(id(param), None)
            if carry is not None:
                if param.grad is None:
                    param.grad = carry
                else:
                    _local(param.grad).add_(_local(carry))
            if param.grad is not None:
                self._written[id(param)] = weakref.ref(param.grad)
        if len(present) == n_params or self.platform.is_fake(flat):   # no tail, or no values (a dry run)
            return set()
        tail = flat[flat.shape[0] - 4:].tolist()
        return {k for k in range(4) if tail[k] > 0}

    @staticmethod
    def _add_reduced(param, reduced):
        """``param.grad`` (None, or an earlier backward's reduced gradient) plus ``reduced``."""
        if param.grad is not None:
            _local(param.grad).add_(reduced)
            return
        param.grad = reduced if not isinstance(param, DTensor) else DTensor.from_local(
            reduced, param.device_mesh, param.placements, shape=param.shape)


def _local(tensor):
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def data_parallel(module, device_mesh, *, average=True, bucket_mb=DEFAULT_BUCKET_MB):
    """All-reduce every parameter gradient of ``module`` over the 1-D ``device_mesh`` after each
    backward; ``average=False`` sums (for losses already normalised by the global token count).
    Adds ``module.no_sync()``. Returns the module.

    MindSpore (gradients as one tuple): pass the ``nn.TrainOneStepCell``; its ``grad_reducer``
    becomes the all-reduce (``core/data_parallel_tuple.py``, docs/training.md)."""
    check_float("data_parallel", "bucket_mb", bucket_mb, positive=True, fix="the bucket size in MB (e.g. 25)")
    if getattr(module, "_hp_grad_reducer", None) is not None:
        raise ValueError("data_parallel was already applied to this module")
    if getattr(get_platform(), "gradients_as_tuple", False):
        return tuple_data_parallel(module, device_mesh, average, bucket_mb)
    reducer = GradientReducer(module, device_mesh, average, bucket_mb)
    module._hp_grad_reducer = reducer
    module.no_sync = reducer.no_sync
    return module
