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
from hyper_parallel.core.data_parallel_checks import Switchable, check_disjoint_meshes, check_one_dim
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
    """The hooks data_parallel installs; ``module._hp_grad_reducer`` after wrapping."""

    def __init__(self, module, device_mesh, average, bucket_mb):
        check_one_dim(device_mesh)
        self.platform = get_platform()
        self.mesh = device_mesh
        self.group = device_mesh.get_group()
        self.op = "avg" if average else "sum"
        self.enabled = True
        named = [(n, p) for n, p in self.platform.named_parameters(module, recurse=True) if p.requires_grad]
        for name, param in named:
            check_disjoint_meshes(param, device_mesh, name)
        params = [p for _, p in named]
        self.buckets = self._make_buckets(params, bucket_mb * 2 ** 20)
        self.bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self._reset()
        self.remove = self.platform.register_grad_ready_hooks(params, self._on_ready, self._on_backward_end)

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
            for bucket, grads, handle in self.pending:
                self._write_back(bucket, grads, handle.wait())
        finally:
            self._reset()

    def _drain(self):
        for _, _, handle in self.pending:
            handle.wait()

    # ------------------------------------------------------------------ one bucket
    def _launch(self, bucket):
        grads = [self._local_grad(p) for p in bucket.params]
        # one presence flag per parameter rides along: whether any rank computed its gradient is
        # then known exactly (a gradient that is exactly zero everywhere is still a gradient)
        present = [1.0 if p.grad is not None else 0.0 for p in bucket.params]
        flags = self.platform.tensor(present, dtype=grads[0].dtype, device=grads[0].device)
        flat = self.platform.cat([g.reshape(-1) for g in grads] + [flags], 0)
        handle = self.platform.all_reduce(flat, self.group, op=self.op, async_op=True, tag="dp_all_reduce")
        self.pending.append((bucket, grads, handle))
        self.next_launch += 1

    def _local_grad(self, param):
        grad = param.grad
        if grad is None:  # unused on this rank: contributes zeros
            local = param._local_tensor if isinstance(param, DTensor) else param
            return self.platform.zeros(tuple(local.shape), dtype=local.dtype, device=local.device)
        return grad._local_tensor if isinstance(grad, DTensor) else grad

    def _write_back(self, bucket, grads, flat):
        offset, flags = 0, None
        for i, (param, grad) in enumerate(zip(bucket.params, grads)):
            n = grad.numel()
            reduced = flat[offset:offset + n].reshape(tuple(grad.shape))
            offset += n
            if param.grad is not None:
                grad.copy_(reduced)
                continue
            if flags is None:   # read on the host only where this rank lacks a gradient
                flags = flat[flat.shape[0] - len(grads):].tolist()
            if flags[i] > 0:
                # used on another rank only: take its gradient; never give an everywhere-unused
                # parameter a zero gradient (optimizers would still step it)
                param.grad = reduced if not isinstance(param, DTensor) else DTensor.from_local(
                    reduced, param.device_mesh, param.placements, shape=param.shape)


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
