"""fully_shard where gradients come as one tuple (MindSpore): the all-gather is part of the graph.

Such a framework's training step differentiates the loss with respect to the Parameters the
optimizer holds (``nn.TrainOneStepCell``: ``optimizer.parameters``) and returns one gradient
tuple in their shapes; there is no ``.grad`` to fill from a hook and no gradient for a tensor the
forward did not read. So the sharded Parameter (this rank's rows, what ``trainable_params()``, the
optimizer and its state see) must itself be what the forward reads: the unit's forward pre-hook
pads and concatenates its shards into one flat buffer and all-gathers it through a differentiable
function whose backward reduce-scatters the flat gradient (averaged or summed; HSDP then
all-reduces the shard over dp_replicate), and installs the gathered tensors as the Cell's
attributes; the post-hook puts the sharded DTensor views back. The gradient in the tuple is
therefore already this rank's reduced rows: the train step's ``grad_reducer`` stays as it is.

A tensor-parallel parameter (a DTensor on a 1-D TP mesh) is split the same way within its TP shard:
the view lives on the concatenated (dp..., tp) mesh as on torch, and the gathered tensor is the TP
DTensor the Cell computes with.

What torch's path does and this one cannot (docs/fully_shard.md, "MindSpore"): the framework's
autograd keeps the gathered tensors it saved until backward (so backward does not re-gather and
``reshard_after_forward`` frees nothing), there is no prefetch (the next unit's gather cannot be
issued inside this unit's differentiated call), and gradient accumulation without reduction
(``set_requires_gradient_sync(False)``) has no place to keep an unreduced full gradient.
"""
from typing import Any
import math

from hyper_parallel.core.autograd_functions import lazy_autograd_function
from hyper_parallel.core.data_parallel.reducer import Collective, FlatReduction
from hyper_parallel.core.dtensor.dtensor import DTensor
from hyper_parallel.core.dtensor.layout import chunk_range
from hyper_parallel.core.fully_shard.state import _cast_floating
from hyper_parallel.platform import get_platform


def _gather_forward(ctx, flat, mesh_info, op, reduce_dtype):
    ctx.mesh_info, ctx.op, ctx.reduce_dtype, ctx.dtype = mesh_info, op, reduce_dtype, flat.dtype
    return get_platform().all_gather(flat, mesh_info.shard_group, 0)


def _gather_backward(ctx, grad):
    """The flat gradient of every rank, reduce-scattered: this rank's flat piece, reduced."""
    info = ctx.mesh_info
    if grad.dtype != ctx.reduce_dtype:
        grad = grad.to(ctx.reduce_dtype)
    # the one gradient reducer's reduce-scatter (core/data_parallel/reducer.py); no presence flags:
    # the graph gives every rank a (possibly zero) gradient for every gathered parameter
    reduction = FlatReduction(Collective.REDUCE_SCATTER, info.shard_group, ctx.op, async_op=False)
    shard = reduction.reduce_flat(grad, info.replicate_group)
    if shard.dtype != ctx.dtype:
        shard = shard.to(ctx.dtype)
    return shard, None, None, None


_GATHER = lazy_autograd_function("FullyShardGather", _gather_forward, _gather_backward)


def _check_owned(owned, mesh_info):
    """What this path cannot shard, refused by name (from arguments only: the same on every rank)."""
    platform = get_platform()
    n = mesh_info.shard_size
    for param, locations in owned:
        label = f"{type(locations[0][0]).__name__}.{locations[0][1]}"
        if len(locations) > 1:
            names = [f"{type(m).__name__}.{n}" for m, n in locations]
            raise NotImplementedError(f"fully_shard on {platform.name}: a parameter shared by {names} (tied "
                                      f"weights) is not supported; untie it")
        if isinstance(param, DTensor):   # a TP parameter: its own rows are what fully_shard splits
            mesh_info.sharded_spec(tuple(param.shape), param._spec, label)   # raises for bad TP meshes
            param = param._local_tensor
        if not tuple(param.shape):
            raise ValueError(f"fully_shard: parameter {label} is 0-dimensional and has no dim 0 to shard; "
                             f"make it shape (1,) or keep it outside the sharded module")
        rows = tuple(param.shape)[0] if tuple(param.shape) else 0
        if rows and any(chunk_range(0, rows, n, r)[1] == 0 for r in range(n)):
            # MindSpore's optimizers create their state with initializer(), which refuses a 0 size
            raise ValueError(f"fully_shard on {platform.name}: parameter {label} has {rows} rows, which "
                             f"split over {n} ranks leave a rank without rows; an empty Parameter cannot "
                             f"be optimized here. Give dim 0 at least {n} rows splitting without an empty "
                             f"rank (e.g. a multiple of {n}), or use a smaller mesh")


class TupleParam:
    """One parameter: its sharded DTensor view (local: the Cell's Parameter) and its padded slot."""

    def __init__(self, module: Any, name: str, param: Any, mesh_info: Any) -> None:
        label = f"{type(module).__name__}.{name}"
        global_shape = tuple(param.shape)
        # a tensor-parallel parameter: fully_shard splits (and gathers back) this rank's TP shard
        self.tp_spec = param._spec if isinstance(param, DTensor) else None
        if self.tp_spec is not None:
            param = param._local_tensor
        shape = tuple(param.shape)
        self.module, self.name, self.shape = module, name, shape
        n, rows = mesh_info.shard_size, shape[0]
        self.row_numel = math.prod(shape[1:])
        self.padded_numel = -(-rows // n) * self.row_numel
        start, size = chunk_range(0, rows, n, mesh_info.shard_rank)
        local = param[start:start + size]
        spec = mesh_info.sharded_spec(global_shape, self.tp_spec, label)
        get_platform().set_parameter(module, name, DTensor._make(local, spec))
        self.view = dict(get_platform().named_parameters(module))[name]
        self.offset = 0

    def padded_piece(self, dtype: Any) -> Any:
        """This rank's rows, flat, cast to ``dtype`` and padded with zeros to ``padded_numel``."""
        platform = get_platform()
        local = self.view._local_tensor
        pieces = [local.reshape(-1)] if local.numel() else []
        if local.dtype != dtype and pieces:
            pieces = [pieces[0].to(dtype)]
        missing = self.padded_numel - local.numel()
        if missing:
            pieces.append(platform.zeros((missing,), dtype=dtype))
        return pieces

    def gathered(self, gathered2d: Any) -> Any:
        """The whole parameter from the all-gather's [ranks, flat size] output: the ranks' padded
        pieces are its rows in order, padding only at the end (rows split as chunk splits them)."""
        block = gathered2d[:, self.offset:self.offset + self.padded_numel].reshape(-1)
        whole = block[:self.shape[0] * self.row_numel].reshape(self.shape)
        return whole if self.tp_spec is None else DTensor._make(whole, self.tp_spec)


class TupleUnit:
    """One fully_shard unit on a tuple-gradient platform: the hooks of the module docstring."""

    def __init__(self, module: Any, owned: Any, mesh_info: Any, policy: Any, average: Any) -> None:
        _check_owned(owned, mesh_info)   # all of them before the first parameter changes
        self.params = [TupleParam(locations[0][0], locations[0][1], param, mesh_info)
                       for param, locations in owned]
        self.mesh_info, self.policy, self.op = mesh_info, policy, "avg" if average else "sum"
        self.flat_numel = 0
        for p in self.params:
            p.offset = self.flat_numel
            self.flat_numel += p.padded_numel
        self.unsharded = False
        self.keep = False   # unshard() was called: stay gathered until reshard()
        self.flags = {"reshard_after_forward": True, "reshard_after_backward": True}
        platform = get_platform()
        platform.register_forward_pre_hook(module, self._pre_forward, with_kwargs=True)
        platform.register_forward_hook(module, self._post_forward, with_kwargs=True)

    def _dtypes(self):
        orig = self.params[0].view.dtype
        dtypes = {p.view.dtype for p in self.params}
        if len(dtypes) > 1 and self.policy.param_dtype is None:
            raise ValueError(f"fully_shard: one unit holds parameters of dtypes {sorted(map(str, dtypes))}; "
                             f"its flat all-gather needs one: give them one dtype, or set "
                             f"MixedPrecisionPolicy(param_dtype=...)")
        param_dtype = self.policy.param_dtype or orig
        return param_dtype, self.policy.reduce_dtype or param_dtype

    def unshard(self) -> None:
        """Gather and install the whole parameters (differentiably when the framework records)."""
        if self.unsharded or not self.params:
            return
        platform = get_platform()
        param_dtype, reduce_dtype = self._dtypes()
        flat = platform.cat([piece for p in self.params for piece in p.padded_piece(param_dtype)], 0)
        gathered = _GATHER(flat, self.mesh_info, self.op, reduce_dtype)
        gathered2d = gathered.reshape(self.mesh_info.shard_size, self.flat_numel)
        for p in self.params:
            platform.swap_parameter(p.module, p.name, p.gathered(gathered2d))
        self.unsharded = True

    def reshard(self) -> None:
        platform = get_platform()
        for p in self.params:
            platform.swap_parameter(p.module, p.name, p.view)
        self.unsharded = False

    def set_flag(self, field: Any, flag: Any) -> None:
        """set_requires_gradient_sync / set_reshard_after_forward / set_reshard_after_backward."""
        if field == "requires_gradient_sync" and not flag:
            raise NotImplementedError(f"set_requires_gradient_sync(False) on {get_platform().name}: the "
                                      f"gradient tuple has each Parameter's sharded shape, so an unreduced "
                                      f"whole gradient has nowhere to accumulate; accumulate the reduced "
                                      f"gradient tuples of the micro-batches instead")
        # the reshard flags are kept for the API, but change nothing here (module docstring)
        self.flags[field] = flag

    def _pre_forward(self, module, args, kwargs):
        if get_platform().is_grad_enabled():
            self.reshard()   # gathered outside this graph (unshard()): gather again inside it
        self.unshard()
        policy = self.policy
        if policy.param_dtype is not None and policy.cast_forward_inputs:
            args, kwargs = _cast_floating((args, kwargs), policy.param_dtype)
        return args, kwargs

    def _post_forward(self, module, args, kwargs, output):
        if not self.keep:
            self.reshard()
        if self.policy.output_dtype is not None:
            output = _cast_floating(output, self.policy.output_dtype)
        return output
