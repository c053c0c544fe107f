"""One parameter under fully_shard.

Its shard is the DTensor the optimizer sees (``sharded``): rows ``chunk_range`` of dim 0, as
``torch.chunk`` splits them, so uneven sizes leave the last ranks fewer (or no) rows. In the flat
collectives every rank's piece is padded to ``padded_rows`` rows, so one all-gather of equal
pieces serves every parameter of a unit; the padding never reaches the parameter or its gradient.

The unsharded tensor the module computes with is made once (``unsharded``: a plain parameter, or
for a tensor-parallel parameter a DTensor of its TP layout) and keeps its identity: resharding
frees its memory, unsharding refills the same object, so tensors autograd saved in forward are
valid again when backward re-gathers.
"""
from typing import Any
import math

from hyper_parallel.core.dtensor.dtensor import DTensor, as_layout
from hyper_parallel.core.dtensor.layout import chunk_range
from hyper_parallel.core.fully_shard import wrap_state
from hyper_parallel.platform import get_platform


class FSDPParam:
    def __init__(self, locations: Any, param: Any, mesh_info: Any, text: Any = None) -> None:
        """``locations``: every (module, attribute name) holding ``param`` (tied weights have several);
        ``text``: how errors name it (its path in the unit)."""
        platform = get_platform()
        self.locations = locations
        name = f"{type(locations[0][0]).__name__}.{locations[0][1]}"
        self.text = text or name
        self.tp_spec = param._spec if isinstance(param, DTensor) else None
        full = platform.detach(param._local_tensor if self.tp_spec is not None else param)
        if len(full.shape) == 0:
            raise ValueError(f"fully_shard: parameter {name} is 0-dimensional and has no dim 0 to shard; "
                             f"make it shape (1,) or keep it outside the sharded module")
        self.requires_grad = bool(param.requires_grad)
        self.orig_dtype = param.dtype
        self.unsharded_shape = tuple(full.shape)
        n = mesh_info.shard_size
        rows = self.unsharded_shape[0]
        self.row_numel = math.prod(self.unsharded_shape[1:])
        self.padded_rows = -(-rows // n)
        self.padded_numel = self.padded_rows * self.row_numel
        start, size = chunk_range(0, rows, n, mesh_info.shard_rank)
        local = full[start:start + size].clone()
        spec = mesh_info.sharded_spec(tuple(param.shape), self.tp_spec, name)
        dt = DTensor._make(local, spec)
        self.sharded = platform.Parameter(dt, requires_grad=self.requires_grad)
        self.swap(self.sharded)
        self.offset = 0            # of this parameter's piece in a rank's flat buffer (set by the group)
        self.unsharded: Any = None      # the gathered parameter the module computes with
        self.unsharded_local: Any = None
        self.accumulated = None    # unreduced gradient kept by set_requires_gradient_sync(False)

    # ------------------------------------------------------------------ identity
    def swap(self, value: Any) -> None:
        platform = get_platform()
        for module, attr in self.locations:
            platform.swap_parameter(module, attr, value)

    def refresh(self) -> None:
        """Adopt the registered DTensor if the module replaced it (``to_empty`` makes new
        parameter objects); must run while sharded."""
        module, attr = self.locations[0]
        current: Any = dict(get_platform().named_parameters(module)).get(attr)
        replaced = current is not self.sharded and isinstance(current, DTensor)
        if replaced and current._spec == self.sharded._spec:
            wrap_state.retire(self.sharded, self.text)
            self.sharded = current
            self.swap(current)
        local = self.sharded._local_tensor
        if getattr(local, "is_meta", False):
            raise ValueError(f"fully_shard: parameter {attr} of {type(module).__name__} is still on the meta "
                             f"device; call model.to_empty(device=...) and initialise the parameters before "
                             f"the first forward")

    def set_requires_grad(self, flag: Any) -> None:
        """Adopt a ``requires_grad`` the user changed after wrapping, on both of its objects."""
        self.requires_grad = flag
        for tensor in (self.sharded, self.unsharded):
            if tensor is not None and bool(tensor.requires_grad) != flag:
                tensor.requires_grad_(flag)

    def init_unsharded(self, dtype: Any) -> None:
        """Create the unsharded tensor once (its memory freed until the first unshard)."""
        local = self.sharded._local_tensor
        if self.unsharded is not None and self.unsharded_local.dtype == dtype and \
                self.unsharded_local.device == local.device:
            return
        platform = get_platform()
        self.unsharded_local = platform.empty(self.unsharded_shape, dtype=dtype, device=local.device)
        if self.tp_spec is None:
            self.unsharded = platform.Parameter(self.unsharded_local, requires_grad=self.requires_grad)
            self.unsharded_local = self.unsharded
        else:
            self.unsharded = DTensor._make(self.unsharded_local, self.tp_spec,
                                           requires_grad=self.requires_grad)
        platform.free_storage(self.unsharded_local)

    # ------------------------------------------------------------------ all-gather side
    def copy_shard_into(self, flat: Any) -> None:
        """This rank's shard into its padded slot of the flat all-gather input (casting)."""
        local = self.sharded._local_tensor
        n = local.numel()
        if n:
            flat[self.offset:self.offset + n].copy_(local.reshape(-1))

    def copy_gathered_out(self, gathered: Any) -> None:
        """Fill the unsharded tensor from ``gathered`` ([ranks, flat size]): whole blocks in one copy,
        then the one partial block of an uneven split."""
        platform = get_platform()
        platform.alloc_storage(self.unsharded_local)
        dst = platform.untracked(self.unsharded_local).view(-1)
        src = gathered[:, self.offset:self.offset + self.padded_numel]
        rows, pr, rn = self.unsharded_shape[0], self.padded_rows, self.row_numel
        full = rows // pr if pr else 0
        if full:
            dst[:full * self.padded_numel].view(full, self.padded_numel).copy_(src[:full])
        rest = (rows - full * pr) * rn
        if rest:
            dst[full * self.padded_numel:].copy_(src[full, :rest])

    def free(self) -> None:
        get_platform().free_storage(self.unsharded_local)

    # ------------------------------------------------------------------ reduce-scatter side
    def take_grad(self) -> Any:
        """The unsharded gradient as a plain tensor in the unsharded layout (a TP gradient in its
        TP layout first), plus any accumulated one; detached from the parameter."""
        grad = self.unsharded.grad
        if grad is not None:
            self.unsharded.grad = None
            if isinstance(grad, DTensor):
                grad = as_layout(grad, self.tp_spec)._local_tensor
        if self.accumulated is not None:
            grad = self.accumulated if grad is None else self.accumulated + grad
            self.accumulated = None
        return grad

    def accumulate(self, reduce_dtype: Any) -> None:
        """set_requires_gradient_sync(False): keep the gradient unreduced, in the reduction dtype."""
        grad = self.take_grad()
        if grad is not None:
            self.accumulated = grad.to(reduce_dtype)

    def copy_grad_into(self, flat2d: Any, grad: Any) -> None:
        """``grad`` into the padded blocks of the reduce-scatter input ([ranks, flat size]); the
        padding stays as it is (summed, never read)."""
        dst = flat2d[:, self.offset:self.offset + self.padded_numel]
        src = grad.reshape(-1)
        rows, pr, rn = self.unsharded_shape[0], self.padded_rows, self.row_numel
        full = rows // pr if pr else 0
        if full:
            dst[:full].copy_(src[:full * self.padded_numel].view(full, self.padded_numel))
        rest = (rows - full * pr) * rn
        if rest:
            dst[full, :rest].copy_(src[full * self.padded_numel:])

    def zero_grad_slot(self, flat2d: Any) -> None:
        """Zeros in this parameter's blocks of the reduce-scatter input (no gradient on this rank)."""
        flat2d[:, self.offset:self.offset + self.padded_numel].zero_()

    def set_sharded_grad(self, shard_flat: Any) -> None:
        """This rank's reduced rows from the flat reduce-scatter output, as the DTensor gradient of
        ``sharded`` (added to an existing one, as autograd accumulates)."""
        local = self.sharded._local_tensor
        grad = shard_flat[self.offset:self.offset + local.numel()].view(tuple(local.shape))
        if grad.dtype != local.dtype:
            grad = grad.to(local.dtype)
        if self.sharded.grad is None:
            self.sharded.grad = DTensor._make(grad, self.sharded._spec)
        else:
            self.sharded.grad._local_tensor.add_(grad)
