"""Data parallelism where gradients come as one tuple (MindSpore): the reducer of ``data_parallel``.

MindSpore's training step computes every gradient at once and passes the tuple through its
``grad_reducer`` Cell before the optimizer (``nn.TrainOneStepCell``). ``data_parallel(step, mesh)``
puts :class:`TupleGradReducer` there (``platform.install_grad_reducer``): the gradients are
flattened into buckets of a few MB per dtype, each all-reduced over the data-parallel mesh (mean, or
sum with ``average=False``), and the tuple comes back in the same order and shapes.

Tensor-parallel parameters are MindSpore Parameters holding this rank's shard, so their gradients
are shards too: all-reducing them over the data-parallel mesh (whose ranks hold the same shard)
keeps the layout. Their own mesh must not share ranks with the data-parallel mesh (ValueError).
"""
from hyper_parallel.core.agreement import check_agreement
from hyper_parallel.core.bounded_cache import lifetime_key
from hyper_parallel.core.data_parallel_checks import Switchable, check_disjoint_meshes, check_one_dim
from hyper_parallel.core.dtensor.dtensor import DTensor
from hyper_parallel.platform import get_platform


def _views(platform, module):
    """(dotted name, parameter or its DTensor view) of every parameter under ``module``."""
    for prefix, cell in platform.named_modules(module):
        for name, param in platform.named_parameters(cell):
            yield (f"{prefix}.{name}" if prefix else name), param


class TupleGradReducer(Switchable):
    """``reducer(grads) -> grads``: the all-reduced gradient tuple (see the module docstring)."""

    def __init__(self, module, device_mesh, average, bucket_mb):
        check_one_dim(device_mesh)
        self.platform = get_platform()
        for name, param in _views(self.platform, self.platform.train_step_network(module)):
            check_disjoint_meshes(param, device_mesh, name)
        self.mesh = device_mesh
        self.group = device_mesh.get_group()
        self.op = "avg" if average else "sum"
        self.cap_bytes = bucket_mb * 2 ** 20
        self.enabled = True

    def __call__(self, grads):
        if not self.enabled or self.mesh.size() == 1:
            return grads
        self.platform.check_execution_mode("data_parallel's gradient reducer")
        grads = tuple(grads)
        # the buckets' all-reduces match only if every rank reduces the same gradients: checked at
        # the first call of each reducer and gradient layout (every call under HP_CHECK_RANKS=every)
        check_agreement(self.mesh, "data_parallel", {
            "gradient shapes": tuple(tuple(int(s) for s in g.shape) for g in grads),
            "gradient dtypes": tuple(str(g.dtype) for g in grads)},
            signature=("gradients", lifetime_key(self)),
            fix="wrap the same model and optimizer on every rank")
        locals_ = [g._local_tensor if isinstance(g, DTensor) else g for g in grads]
        reduced = list(locals_)
        # every bucket's all-reduce is started before the first is waited for (they overlap where
        # the backend runs collectives asynchronously)
        pending = [(bucket, self.platform.all_reduce(
            self.platform.cat([locals_[i].reshape(-1) for i in bucket], 0), self.group, op=self.op,
            async_op=True, tag="dp_all_reduce")) for bucket in self._buckets(locals_)]
        for bucket, handle in pending:
            flat = handle.wait()
            offset = 0
            for i in bucket:
                n = locals_[i].numel()
                reduced[i] = flat[offset:offset + n].reshape(tuple(locals_[i].shape))
                offset += n
        return tuple(DTensor._make(r, g._spec) if isinstance(g, DTensor) else r
                     for g, r in zip(grads, reduced))

    def _buckets(self, tensors):
        """Index lists, same dtype each, at most ``cap_bytes`` (one tensor may exceed it); the
        order is the tuple's, identical on every rank, so every rank issues the same collectives."""
        buckets, open_by_dtype, sizes = [], {}, {}
        for i, t in enumerate(tensors):
            if t.numel() == 0:
                continue
            nbytes = t.numel() * t.element_size() if hasattr(t, "element_size") else t.nbytes
            key = str(t.dtype)
            bucket = open_by_dtype.get(key)
            if bucket is None or sizes[id(bucket)] + nbytes > self.cap_bytes:
                bucket = []
                open_by_dtype[key] = bucket
                sizes[id(bucket)] = 0
                buckets.append(bucket)
            bucket.append(i)
            sizes[id(bucket)] += nbytes
        return buckets


def tuple_data_parallel(module, device_mesh, average, bucket_mb):
    """``data_parallel`` on a platform whose gradients come as a tuple: a ``TrainOneStepCell``
    gets the reducer as its ``grad_reducer``; any Cell gets ``module.grad_reducer_fn`` (call it on
    the gradients of a hand-written step) and ``module.no_sync()``."""
    platform = get_platform()
    platform.check_execution_mode("data_parallel")
    reducer = TupleGradReducer(module, device_mesh, average, bucket_mb)
    platform.install_grad_reducer(module, reducer, "a data_parallel Cell")
    attrs = (("_hp_grad_reducer", reducer), ("grad_reducer_fn", reducer), ("no_sync", reducer.no_sync))
    for attr, value in attrs:
        object.__setattr__(module, attr, value)
    return module
