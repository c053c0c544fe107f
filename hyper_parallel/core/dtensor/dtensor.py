"""DTensor: a global tensor stored as one shard per rank of a DeviceMesh.

The class is framework-neutral: the platform supplies its base (for torch, a wrapper tensor
subclass) and core does the rest. Conversions between local and distributed views and between
layouts are the three differentiable functions below.

Every entry point the platform's base class calls is a method of the class below, delegating to one
``EntryPoints`` object: the dispatcher (``dispatch/``), the aten-level path (``aten/``),
checkpointing and the casting redistribution. Those modules import DTensor (to wrap their
results), so DTensor cannot import them (tests/test_import_graph.py: no cycle, deferred imports
counted); the package's ``__init__`` binds them to ``ENTRY_POINTS`` in one visible call. Nothing is
installed on the class itself.
"""
from typing import Any, Callable, Optional, Sequence, Tuple

from hyper_parallel.core.autograd_functions import lazy_autograd_function
from hyper_parallel.core.dtensor import rank_check as rc
from hyper_parallel.core.dtensor.device_mesh import DeviceMesh
from hyper_parallel.core.dtensor.layout import grad_placements
from hyper_parallel.core.dtensor.mesh_registry import remember_mesh, resolve_mesh
from hyper_parallel.core.dtensor.placement_types import Partial, Placement, Replicate, normalize_placements
from hyper_parallel.core.dtensor.redistribute import redistribute_local
from hyper_parallel.core.dtensor.spec import DTensorSpec
from hyper_parallel.core.typing import DType, Tensor
from hyper_parallel.platform import get_platform


class DTensor(get_platform().DTensorBase):  # type: ignore[misc]  # the platform's base, chosen at import

    @classmethod
    def _make(cls, local_tensor, spec, requires_grad=False):
        """Wrap without autograd: ``local_tensor`` is this rank's shard of ``spec``."""
        obj = cls.__new__(cls, local_tensor, spec.shape, requires_grad=requires_grad)
        obj._local_tensor = local_tensor
        obj._spec = spec
        return obj

    # ------------------------------------------------------------------ entry points
    # The platform's base class calls these; each delegates to the module that implements it.
    @staticmethod
    def _hp_function(name, func, args, kwargs, hit_only=False):
        """Every user-level op call on a DTensor: the fast path, else rule -> redistribute -> local
        op -> wrap (dispatch/fast_path.py, dispatch/dispatcher.py)."""
        return ENTRY_POINTS.function(name, func, args, kwargs, hit_only)

    @staticmethod
    def _hp_replicated(name, op, args, kwargs):
        """An op without a rule at the function level (MindSpore): replicated (dispatch/fallback.py)."""
        return ENTRY_POINTS.replicated(name, op, args, kwargs)

    @staticmethod
    def _hp_aten(func, args, kwargs):
        """An aten op reaching a DTensor below autograd (torch; aten/aten_dispatch.py)."""
        return ENTRY_POINTS.aten(func, args, kwargs)

    @staticmethod
    def _hp_fused(func, args, kwargs):
        """A fused optimizer step (torch's ``_fused_*`` ops; aten/foreach.py)."""
        return ENTRY_POINTS.fused(func, args, kwargs)

    def _hp_describe(self):
        """The plain-data description a pickled DTensor carries (checkpoint.py)."""
        return ENTRY_POINTS.describe(self)

    def _hp_checkpoint_box(self):
        """(offsets, sizes) of this rank's piece for a checkpoint, or None (checkpoint.py)."""
        return ENTRY_POINTS.checkpoint_box(self)

    @staticmethod
    def _hp_rebuild(local, mesh_desc, placements, shape, requires_grad):
        """A DTensor from its pickled description (checkpoint.py)."""
        return ENTRY_POINTS.rebuild(local, mesh_desc, placements, shape, requires_grad)

    # gradient-layout hooks: MindSpore's autograd bridge carries gradients as local tensors
    def _hp_grad_spec(self):
        """The layout of this DTensor's gradient: its placements, a Partial one replicated."""
        return self._spec.with_placements(grad_placements(self._spec.placements))

    @staticmethod
    def _hp_as_layout(value, spec):
        return as_layout(value, spec)

    # ------------------------------------------------------------------ construction
    @staticmethod
    def from_local(local_tensor: Tensor, device_mesh: Optional[DeviceMesh] = None,
                   placements: Optional[Sequence[Placement]] = None, *,
                   run_check: bool = False, shape: Optional[Sequence[int]] = None,
                   stride: Optional[Sequence[int]] = None,
                   grad_placements: Optional[Sequence[Placement]] = None) -> "DTensor":
        """The DTensor whose shard on this rank is ``local_tensor`` (differentiable).

        Without ``shape`` the shards are taken to be even; pass the global ``shape`` for uneven ones.
        ``device_mesh`` defaults to the ``with mesh:`` mesh, ``placements`` to replicated.
        ``grad_placements``: the layout in which ``local_tensor``'s gradient is taken from the
        DTensor's gradient (default: this DTensor's placements, a Partial one replicated).

        Ranks that disagree (ndim, dtype, placements, uneven pieces without ``shape``) get the same
        ValueError on every rank before any collective that depends on it: the check runs on the
        first call of each signature, on every call with ``run_check=True`` or ``HP_DTENSOR_DEBUG=1``
        (rank_check.py). ``run_check=True`` also gives every rank of a Replicate mesh dim the first
        rank's value, as PyTorch does; debug mode instead raises when Replicate pieces differ."""
        device_mesh = remember_mesh(resolve_mesh(device_mesh, "DTensor.from_local"))
        given = placements or [Replicate()] * device_mesh.ndim
        spec, problem = _local_spec(local_tensor, device_mesh, given, shape)
        if device_mesh.get_coordinate() is None:
            if problem is not None:
                raise problem
            # as PyTorch: a rank outside the mesh holds an empty piece and joins no collective
            return DTensor._make(_empty_like(local_tensor), spec,
                                 requires_grad=bool(get_platform().requires_grad(local_tensor)))
        # hashed on every call (the TP hooks' hot path): placements and dtypes hash by value
        key = (device_mesh, tuple(given), None if shape is None else tuple(int(s) for s in shape),
               tuple(local_tensor.shape), local_tensor.dtype)
        if run_check or problem is not None or rc.needs_check(key):
            rc.check_pieces(local_tensor, device_mesh, given, spec, shape is not None, problem,
                            "DTensor.from_local(run_check=True)" if run_check else "DTensor.from_local")
            if rc.debug_checks():
                rc.check_replicated_values(local_tensor, device_mesh, spec.placements)
            rc.mark_verified(key)
        if run_check:
            local_tensor = rc.broadcast_replicated(local_tensor, device_mesh, spec.placements)
        grad_spec = None if grad_placements is None else spec.with_placements(
            normalize_placements(grad_placements, len(spec.shape), device_mesh.ndim))
        return _from_local(local_tensor, spec, grad_spec=grad_spec)

    def to_local(self, *, grad_placements: Optional[Sequence[Placement]] = None) -> Tensor:
        """This rank's shard (differentiable; its gradient has this DTensor's placements)."""
        spec = self._spec if grad_placements is None else self._spec.with_placements(
            normalize_placements(grad_placements, self.ndim, self._spec.mesh.ndim))
        return _to_local(self, spec)

    def redistribute(self, device_mesh: Optional[DeviceMesh] = None,
                     placements: Optional[Sequence[Placement]] = None, *, async_op: bool = False,
                     forward_dtype: Optional[DType] = None,
                     backward_dtype: Optional[DType] = None) -> "DTensor":
        """This tensor in another layout on the same mesh (differentiable). ``forward_dtype``: cast
        the shard before the collective (the result has that dtype); ``backward_dtype``: the dtype of
        the backward collective (the input's gradient keeps the input's dtype), as PyTorch."""
        if device_mesh is not None and device_mesh != self._spec.mesh:
            raise ValueError(f"redistribute across meshes ({self._spec.mesh} -> {device_mesh}) is not "
                             f"supported; use the DTensor's own mesh")
        if placements is None:
            raise ValueError("redistribute needs placements, e.g. [Replicate()]")
        placements = normalize_placements(placements, self.ndim, self._spec.mesh.ndim)
        if forward_dtype is not None or backward_dtype is not None:
            return ENTRY_POINTS.redistribute_cast(self, placements, forward_dtype, backward_dtype)
        if placements == self._spec.placements:
            return self
        return _redistribute(self, placements)

    def full_tensor(self, *, grad_placements: Optional[Sequence[Placement]] = None) -> Tensor:
        """The whole global tensor on every rank (differentiable). ``grad_placements``: how the
        gradient of the result is laid out (e.g. ``[Partial()]`` when each rank's gradient is a
        share of the total), default replicated."""
        full = self.redistribute(placements=[Replicate()] * self._spec.mesh.ndim)
        return full.to_local(grad_placements=grad_placements)

    # ------------------------------------------------------------------ metadata
    @property
    def placements(self) -> Tuple[Placement, ...]:
        return self._spec.placements

    @property
    def device_mesh(self) -> DeviceMesh:
        return self._spec.mesh

    @property
    def local_shape(self) -> Tuple[int, ...]:
        return tuple(self._local_tensor.shape)

    def __repr__(self):
        return (f"DTensor(local_tensor={self._local_tensor!r}, device_mesh={self._spec.mesh!r}, "
                f"placements={self._spec.placements}, shape={tuple(self._spec.shape)})")


class EntryPoints:
    """The functions DTensor's entry points delegate to, one field each (the module that defines it):
    function (dispatch/fast_path.py ``dispatch``), replicated (dispatch/fallback.py ``run_replicated``),
    aten (aten/aten_dispatch.py ``dispatch_aten``), fused (aten/foreach.py ``run_fused``), describe /
    checkpoint_box / rebuild (checkpoint.py), redistribute_cast (redistribute_cast.py). Bound once,
    by ``hyper_parallel.core.dtensor``'s ``__init__`` (``bind``)."""
    __slots__ = ("function", "replicated", "aten", "fused", "describe", "checkpoint_box", "rebuild",
                 "redistribute_cast")
    function: Callable[..., Any]
    replicated: Callable[..., Any]
    aten: Callable[..., Any]
    fused: Callable[..., Any]
    describe: Callable[..., Any]
    checkpoint_box: Callable[..., Any]
    rebuild: Callable[..., Any]
    redistribute_cast: Callable[..., Any]

    def __init__(self) -> None:
        for field in self.__slots__:
            setattr(self, field, _unbound(field))

    def bind(self, **functions: Callable[..., Any]) -> None:
        """Set every field (all at once, so a missing one fails here rather than at first use)."""
        if set(functions) != set(self.__slots__):
            raise ValueError(f"EntryPoints.bind needs exactly {sorted(self.__slots__)}, "
                             f"got {sorted(functions)}")
        for field, function in functions.items():
            setattr(self, field, function)


def _unbound(field: str) -> Callable[..., Any]:
    def unbound(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"DTensor's {field!r} entry point is used before hyper_parallel.core.dtensor "
                           f"finished importing; import hyper_parallel.core.dtensor first")
    return unbound


ENTRY_POINTS = EntryPoints()


# ---------------------------------------------------------------------- differentiable conversions
class GradPassThrough:
    """Shared by the autograd nodes of one op call (its inputs' to_local, its single output's
    from_local). ``dims``: the mesh dims on which every input and the output are replicated, so the
    op's local backward is the same linear map on every rank. A Partial(sum) output gradient on such
    a dim then passes through the op as Partial(sum) (``partial``, set by the output's backward,
    read by the inputs'), instead of being all-reduced at every op boundary: e.g. dK of all-gather
    KV attention stays partial through the user's transposes until the one reduce-scatter."""
    __slots__ = ("dims", "partial")

    def __init__(self, dims: Any) -> None:
        self.dims = frozenset(dims)
        self.partial: Any = frozenset()


_PARTIAL_SUM = Partial("sum")


def _from_local_forward(ctx, local, spec, passthrough=None, grad_spec=None):
    ctx.spec = spec
    ctx.passthrough = passthrough
    ctx.grad_spec = grad_spec
    return DTensor._make(local.view_as(local), spec)


def _from_local_backward(ctx, grad):
    target = grad_placements(ctx.spec.placements)
    passthrough = ctx.passthrough
    if passthrough is not None:
        keep = frozenset(m for m in passthrough.dims if isinstance(grad, DTensor)
                         and grad._spec.placements[m] == _PARTIAL_SUM)
        passthrough.partial = keep
        target = tuple(_PARTIAL_SUM if m in keep else p for m, p in enumerate(target))
    if ctx.grad_spec is not None:  # from_local(grad_placements=)
        target = ctx.grad_spec.placements
    grad = as_layout(grad, ctx.spec.with_placements(target))
    # a plain tensor's gradient: autograd itself lays out what it accumulates into a leaf's .grad
    return _dense(grad._local_tensor), None, None, None


def _to_local_forward(ctx, dtensor, grad_spec, passthrough=None):
    ctx.grad_spec = grad_spec
    ctx.passthrough = passthrough
    return dtensor._local_tensor.view_as(dtensor._local_tensor)


def _to_local_backward(ctx, grad):
    return DTensor._make(_dense(grad), _input_grad_spec(ctx.grad_spec, ctx.passthrough)), None, None


# A local gradient crossing a DTensor boundary is copied only where its memory has gaps or overlaps:
# a permuted one (a transpose's gradient) passes as it is. What a leaf accumulates into ``.grad``
# autograd lays out like the leaf (tests/test_grad_layout.py: fused AdamW reads it in memory order).
_dense = get_platform().dense


def _input_grad_spec(spec, passthrough):
    """An input's gradient spec, Partial(sum) where the op's output gradient passed through."""
    if passthrough is not None and passthrough.partial:
        keep = passthrough.partial
        spec = spec.with_placements(tuple(_PARTIAL_SUM if m in keep else p
                                          for m, p in enumerate(spec.placements)))
    return spec


def _redistribute_forward(ctx, dtensor, placements):
    spec = dtensor._spec
    ctx.src = spec
    local = redistribute_local(dtensor._local_tensor, spec.mesh, spec.shape, spec.placements, placements)
    return DTensor._make(local, spec.with_placements(placements))


def _redistribute_backward(ctx, grad):
    return as_layout(grad, ctx.src.with_placements(grad_placements(ctx.src.placements))), None


_from_local_fn = lazy_autograd_function("FromLocal", _from_local_forward, _from_local_backward)
_to_local_fn = lazy_autograd_function("ToLocal", _to_local_forward, _to_local_backward)
_redistribute_fn = lazy_autograd_function("Redistribute", _redistribute_forward, _redistribute_backward)


def _from_local(local, spec, passthrough=None, grad_spec=None):
    if get_platform().is_grad_enabled() and get_platform().requires_grad(local):
        return _from_local_fn(local, spec, passthrough, grad_spec)
    return DTensor._make(local, spec)


def _to_local(dtensor, grad_spec, passthrough=None):
    if get_platform().is_grad_enabled() and dtensor.requires_grad:
        return _to_local_fn(dtensor, grad_spec, passthrough)
    return dtensor._local_tensor


def _redistribute(dtensor, placements):
    if get_platform().is_grad_enabled() and dtensor.requires_grad:
        return _redistribute_fn(dtensor, placements)
    return _redistribute_forward(_NoCtx(), dtensor, placements)


class _NoCtx:
    pass


def as_layout(value: Tensor, spec: Any) -> DTensor:   # spec: a DTensorSpec (callers hold Optional ones)
    """``value`` (a DTensor in any layout, or a plain global tensor) as a DTensor of ``spec``,
    without autograd."""
    if isinstance(value, DTensor):
        src = value._spec
        local = redistribute_local(value._local_tensor, spec.mesh, spec.shape, src.placements,
                                   spec.placements)
        return DTensor._make(local, spec)
    full_spec = spec.with_placements([Replicate()] * spec.mesh.ndim)
    return as_layout(DTensor._make(value, full_spec), spec)


def _empty_like(local):
    return get_platform().empty((0,), dtype=local.dtype, device=getattr(local, "device", None))


def _local_spec(local_tensor, mesh, placements, shape):
    """(spec, None), or (None, the ValueError) when the placements do not fit this rank's tensor
    (a Shard dim beyond its ndim): a rank-dependent error is raised only after the cross-rank check,
    so that every rank raises it."""
    try:
        placements = normalize_placements(placements, len(local_tensor.shape), mesh.ndim)
    except ValueError as exc:
        return None, exc
    if shape is None:
        shape = list(local_tensor.shape)
        for m, p in enumerate(placements):
            if p.is_shard():
                shape[p.dim] *= mesh.size(m)
    return DTensorSpec(mesh, placements, tuple(int(s) for s in shape)), None


__all__ = ["DTensor", "EntryPoints", "ENTRY_POINTS", "as_layout"]
