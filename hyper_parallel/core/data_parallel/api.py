"""data_parallel(module, mesh): all-reduce every parameter gradient over a data-parallel mesh.

The contract and its use in a training step: docs/training.md.

The mesh is whatever set of ranks saw different tokens for the same parameters: a "dp" mesh, the
"cp" mesh (each context-parallel rank sees only its sequence block), or a flattened dp×cp mesh.

Gradients are reduced in buckets of a few MB (same-dtype gradients flattened into one tensor, one
collective each; reducer.py). Where gradients become ready one by one (torch) a bucket is launched
asynchronously as soon as backward has produced all of its gradients, so communication overlaps the
rest of backward, and the end-of-backward callback writes the results back into ``.grad``.

Where they come as one tuple (MindSpore: the training step computes every gradient at once and
passes the tuple through its ``grad_reducer`` Cell before the optimizer, ``nn.TrainOneStepCell``),
:class:`TupleGradReducer` is that reducer (``platform.install_grad_reducer``): the same buckets,
each all-reduced, and the tuple comes back in the same order and shapes.

DTensor parameters (tensor parallel) reduce their local gradient: their shards are different
tensors on different TP ranks, the same tensor on different DP ranks, so the DP mesh must not share
a rank with the DTensor's own mesh (ValueError).
"""
from typing import Any

from hyper_parallel.core.agreement import check_agreement
from hyper_parallel.core.arguments import check_float
from hyper_parallel.core.bounded_cache import lifetime_key
from hyper_parallel.core.data_parallel.checks import Switchable, check_disjoint_meshes, check_one_dim
from hyper_parallel.core.data_parallel.reducer import (DEFAULT_BUCKET_MB, Collective, FlatReduction,
                                                       GradientReducer, plan_buckets)
from hyper_parallel.core.dtensor.device_mesh import DeviceMesh
from hyper_parallel.core.dtensor.dtensor import DTensor
from hyper_parallel.core.typing import Module
from hyper_parallel.platform import get_platform


def _views(platform: Any, module: Any):
    """(dotted name, parameter or its DTensor view) of every parameter under ``module``."""
    for prefix, cell in platform.named_modules(module):
        for name, param in platform.named_parameters(cell):
            yield (f"{prefix}.{name}" if prefix else name), param


class TupleGradReducer(Switchable):
    """``reducer(grads) -> grads``: the all-reduced gradient tuple (see the module docstring)."""

    def __init__(self, module: Module, device_mesh: DeviceMesh, average: bool, bucket_mb: float) -> None:
        check_one_dim(device_mesh)
        self.platform = get_platform()
        for name, param in _views(self.platform, self.platform.train_step_network(module)):
            check_disjoint_meshes(param, device_mesh, name)
        self.mesh = device_mesh
        self.reduction = FlatReduction(Collective.ALL_REDUCE, device_mesh.get_group(),
                                       "avg" if average else "sum", tag="dp_all_reduce")
        self.cap_bytes = bucket_mb * 2 ** 20
        self.enabled = True

    def __call__(self, grads: tuple) -> tuple:
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
        # every gradient is present (no flags); every bucket's all-reduce starts before the first is
        # waited for (they overlap where the backend runs collectives asynchronously)
        pending = [(b, self.reduction.launch([locals_[i] for i in b], flags=False))
                   for b in self._buckets(locals_)]
        reduced = list(locals_)
        for bucket, reduction in pending:
            views = reduction.payload(reduction.wait(), [tuple(locals_[i].shape) for i in bucket])
            for i, view in zip(bucket, views):
                reduced[i] = view
        return tuple(DTensor._make(r, g._spec) if isinstance(g, DTensor) else r
                     for g, r in zip(grads, reduced))

    def _buckets(self, tensors: list) -> list:
        """Index lists of the non-empty ``tensors`` (reducer.plan_buckets), in the tuple's order: the
        same on every rank, so every rank issues the same collectives."""
        sizes = [self.platform.tensor_nbytes(t) for t in tensors]
        return plan_buckets([(i, t.dtype, n) for i, (t, n) in enumerate(zip(tensors, sizes)) if n],
                            self.cap_bytes)


def data_parallel(module: Module, device_mesh: DeviceMesh, *, average: bool = True,
                  bucket_mb: float = DEFAULT_BUCKET_MB) -> Module:
    """All-reduce every parameter gradient of ``module`` over the 1-D ``device_mesh`` after each
    backward; ``average=False`` sums (for losses already normalised by the global token count).
    Adds ``module.no_sync()``. Returns the module.

    MindSpore (gradients as one tuple): pass the ``nn.TrainOneStepCell``; its ``grad_reducer``
    becomes the all-reduce (:class:`TupleGradReducer`, docs/training.md)."""
    check_float("data_parallel", "bucket_mb", bucket_mb, positive=True, fix="the bucket size in MB (e.g. 25)")
    if getattr(module, "_hp_grad_reducer", None) is not None:
        raise ValueError("data_parallel was already applied to this module")
    platform = get_platform()
    if platform.gradients_as_tuple:
        # the gradients become ready together, as the tuple the training step hands its reducer;
        # any Cell gets ``module.grad_reducer_fn`` (call it on the gradients of a hand-written step)
        platform.check_execution_mode("data_parallel")
        reducer = TupleGradReducer(module, device_mesh, average, bucket_mb)
        platform.install_grad_reducer(module, reducer, "a data_parallel Cell")
        attrs = (("_hp_grad_reducer", reducer), ("grad_reducer_fn", reducer), ("no_sync", reducer.no_sync))
        for attr, value in attrs:
            object.__setattr__(module, attr, value)
        return module
    hooks = GradientReducer(module, device_mesh, average, bucket_mb)
    module._hp_grad_reducer = hooks
    module.no_sync = hooks.no_sync
    return module
