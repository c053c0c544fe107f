"""The MindSpore side of DTensor: a ``mindspore.Tensor`` subclass whose operators go to core.

MindSpore has no ``__torch_function__``; it has ``__fallback__``: when an operator (``ops.*``,
``mint.*``, a Tensor method or a Python operator) receives an instance of a Tensor subclass that
defines it, MindSpore calls ``cls.__fallback__(op, args, kwargs)`` instead of running the kernel.
The DTensor's class uses it to hand every operator on DTensors to core's dispatcher
(``DTensor._hp_function``) under the framework-neutral op name from ``op_names.py``; core then
plans the layouts with the op's sharding rule, redistributes, and runs the MindSpore operator on
the local shards under MindSpore's own autograd. Operators without a rule run replicated (the
inputs are all-gathered; a warning names the operator; ``HP_STRICT_DISPATCH=1`` raises).

The object itself is a Tensor whose own data is a placeholder without data (of unknown rank; the
shard is ``_local_tensor``), so it can be passed anywhere MindSpore expects a Tensor, and a code path
that reads a DTensor's data without asking ``__fallback__`` fails loudly instead of computing on
nothing (the C++ entry points that took it silently are handled in placeholder_reads.py); the
Python-level reads are overridden here: ``shape``/``ndim``/``size``/``numel``/
``len`` give the global
shape, indexing goes through the sharding rules, and conversions to numbers or arrays
(``asnumpy``, ``item``, ``tolist``, ``float``...) raise unless the value is a single element
(use ``full_tensor()`` or ``to_local()``). In-place operators on a DTensor are not supported.
A one-element DTensor made while a graph is recorded holds a NaN linked to its local tensor
instead (``_ScalarLink``), so that a DTensor loss returned to ``ms.grad`` is differentiated.

Gradients flow through MindSpore's autograd on the local tensors (``autograd.py`` explains how a
gradient's placements travel with it). Parameters: :func:`set_dtensor_parameter` keeps the local
shard as the Cell's ``mindspore.Parameter`` (what optimizers and ``value_and_grad`` see) and gives
the Cell's code a DTensor view of it.
"""
from typing import Any
import math

import numpy as np

import mindspore as ms
from mindspore.ops.primitive import Primitive

from hyper_parallel.platform.mindspore import meta, placeholder_guard
from hyper_parallel.platform.mindspore.op_names import MsOp, lookup
# the primitives of real models' ops add their entries to op_names' TABLE when imported
from hyper_parallel.platform.mindspore import op_names_models  # noqa: F401

_LIKE = {"ZerosLike", "OnesLike", "ZerosLikeExt", "OnesLikeExt", "EmptyLike", "FullLike", "RandLikeExt",
         "RandnLikeExt"}
_OPS: dict[Any, Any] = {}


def _is_inplace(name):
    return name.startswith("Inplace") or name in ("Assign", "AssignAdd", "AssignSub")


class MindSporeDTensorBase(ms.Tensor):
    """Subclassed by core's ``DTensor`` (core/dtensor/dtensor.py), which provides the hooks this class and
    autograd.py call (``_hp_function``, ``_hp_replicated``, ``_hp_grad_spec``, ``_hp_as_layout``,
    ``_make``): the platform never imports core."""

    # core's ensure_leaf_grad_layout registers a gradient hook on leaf DTensors; on MindSpore the
    # leaf's consumers bring its gradient to its layout instead (autograd.py)
    _hp_hooked = True
    # what every MindSpore compiler asks of an object it turns into a graph value (placeholder_guard.py)
    __parameter__ = placeholder_guard.CompilerSighting()

    def __new__(cls, local_tensor=None, global_shape=None, requires_grad=False):
        if global_shape is None:   # not the library: ms.Parameter(dt), or copy / pickle rebuilding one
            what = "ms.Parameter(dtensor)" if isinstance(local_tensor, ms.Tensor) else "rebuilding a DTensor"
            raise ValueError(_NO_COPY.format(what=what))
        shape = tuple(int(s) for s in global_shape)
        if math.prod(shape) == 1 and _records_gradient(local_tensor):
            placeholder = _ScalarLink.apply(local_tensor, shape)
        else:
            placeholder = _placeholder(local_tensor.dtype, shape)
        obj = ms.Tensor.__new__(cls, placeholder)
        ms.Tensor.__init__(obj, placeholder)
        obj._hp_shape = shape
        obj._hp_requires_grad = bool(requires_grad)
        return obj

    def __init__(self, *args: Any, **kwargs: Any) -> None:  # noqa: D401  (initialised in __new__)
        pass

    # ------------------------------------------------------------------ global metadata
    @property
    def shape(self) -> Any:
        return self._hp_shape

    @property
    def ndim(self) -> int:
        return len(self._hp_shape)

    @property
    def size(self) -> Any:
        return math.prod(self._hp_shape)

    def numel(self) -> Any:
        return math.prod(self._hp_shape)

    nelement = numel

    def dim(self) -> int:
        return len(self._hp_shape)

    ndimension = dim

    def __len__(self):
        if not self._hp_shape:
            raise TypeError("len() of a 0-d DTensor")
        return self._hp_shape[0]

    @property
    def nbytes(self) -> Any:
        return self.numel() * self.itemsize

    # ------------------------------------------------------------------ autograd metadata (core)
    @property
    def requires_grad(self) -> bool:
        return True   # MindSpore decides what is differentiated when ms.grad runs

    def requires_grad_(self, requires_grad: bool = True) -> Any:
        self._hp_requires_grad = bool(requires_grad)
        return self

    @property
    def grad_fn(self) -> Any:
        return None

    # ------------------------------------------------------------------ operators
    @classmethod
    def __fallback__(cls, func, args, kwargs=None, *rest):
        placeholder_guard.check_not_tracing(args)
        name = func.name
        legacy = None
        args = tuple(args)
        if len(args) == 3 and isinstance(args[0], Primitive) and isinstance(args[1], str):
            legacy, args = args[0], tuple(args[2])   # an old-style Primitive call
        kwargs = dict(kwargs or {})
        if legacy is not None and name == "Stack":   # its axis is the Primitive's: the rule must see it
            kwargs.setdefault("axis", legacy.attrs.get("axis", 0))
        if _is_inplace(name):
            raise NotImplementedError(
                f"in-place MindSpore operator {name} on a DTensor is not supported; use the "
                f"out-of-place form (parameters of a parallelized Cell are plain Parameters, which "
                f"optimizers update in place as usual)")
        if name in _LIKE:
            return _like(func, legacy, name, args, kwargs)
        entry = lookup(name)
        normalized = entry.normalize(args, kwargs) if entry is not None and entry.normalize else \
            ((args, kwargs, None, None, None) if entry is not None else None)
        if normalized is None:
            op = MsOp(func, name.lower(), None, name, legacy)
            return _replicated(cls, name, op, args, kwargs)
        args, kwargs, neutral, runner, key, *shape_override = normalized
        shape_fn = shape_override[0] if shape_override else entry.shape_fn
        cache_key = (name, type(func).__name__, legacy is not None, key)
        op = _OPS.get(cache_key)
        if op is None:
            op = _OPS[cache_key] = MsOp(func, entry.display, shape_fn, name, legacy, runner, key)
        elif legacy is not None:
            op = MsOp(func, entry.display, shape_fn, name, legacy, runner, key)
        result = cls._hp_function(neutral or entry.neutral, op, args, kwargs)
        if result is NotImplemented:
            return _replicated(cls, name, op, args, kwargs)
        return result

    def __getitem__(self, index):
        placeholder_guard.check_not_tracing(self)
        result = type(self)._hp_function("getitem", _GETITEM, (self, index), {})
        if result is NotImplemented:
            return _replicated(type(self), "getitem", _GETITEM, (self, index), {})
        return result

    def __setitem__(self, index, value):
        raise NotImplementedError("item assignment on a DTensor is not supported on MindSpore; build the "
                                  "value out of place (e.g. with ops.where / mint.cat)")

    def __iter__(self):
        for i in range(len(self)):
            yield self[i]

    # ------------------------------------------------------------------ values
    def _single_value(self, what):
        if self.numel() != 1:
            raise TypeError(f"{what} of a DTensor with {self.numel()} elements; use dt.full_tensor() or "
                            f"dt.to_local() first")
        return self.full_tensor()

    def item(self) -> Any:
        return self._single_value("item()").item()

    def __float__(self):
        return float(self._single_value("float()").item())

    def __int__(self):
        return int(self._single_value("int()").item())

    def __bool__(self):
        return bool(self._single_value("bool()").item())

    def asnumpy(self) -> Any:
        raise TypeError("a DTensor has no single array: use dt.full_tensor().asnumpy() (the global "
                        "value) or dt.to_local().asnumpy() (this rank's shard)")

    def tolist(self) -> Any:
        raise TypeError("use dt.full_tensor().tolist() or dt.to_local().tolist()")

    def __array__(self, dtype=None):
        raise TypeError("use dt.full_tensor().asnumpy() or dt.to_local().asnumpy()")

    def __str__(self):
        return self.__repr__()

    def __deepcopy__(self, memo):
        import copy
        return type(self)._make(copy.deepcopy(self._local_tensor, memo), self._spec,
                                requires_grad=self._hp_requires_grad)

    def __copy__(self):
        """A DTensor of the same layout sharing this one's local tensor (as a view would)."""
        return type(self)._make(self._local_tensor, self._spec, requires_grad=self._hp_requires_grad)

    def __reduce_ex__(self, protocol):
        raise ValueError(_NO_COPY.format(what="pickling a DTensor"))

    @property
    def data(self) -> Any:
        """The DTensor itself (as ``dt.data`` of a PyTorch DTensor is a DTensor), never the placeholder."""
        return self

    def untyped_storage(self) -> Any:
        raise ValueError(_NO_COPY.format(what="dt.untyped_storage()"))

    def get_bytes(self) -> Any:   # what ms.save_checkpoint reads
        raise ValueError(_NO_COPY.format(what="saving a DTensor's bytes (ms.save_checkpoint)"))

    def register_hook(self, hook: Any) -> Any:
        raise NotImplementedError(
            "dt.register_hook(fn): on MindSpore a DTensor's gradient flows through its local tensor, so a "
            "hook on the DTensor object would never run; register it on the local tensor the DTensor was "
            "made from (DTensor.from_local(local, ...): local.register_hook(fn), the gradient of this "
            "rank's piece) or on the parallelized Cell's Parameter")

    def set_dtype(self, dtype: Any) -> Any:
        raise NotImplementedError("dt.set_dtype(dtype) would retype the DTensor's placeholder, not its "
                                  "shard; use dt = dt.astype(dtype)")

    # MindSpore's protocol for lazily computed tensors: ``Tensor.assign_value`` (and so
    # ``Parameter.set_data``, which ends in it) takes ``value.stub_sync()`` when ``value`` has ``stub``,
    # and would otherwise copy the placeholder in C++ without asking anything else
    stub = True

    def stub_sync(self) -> Any:
        what = "param.set_data(dtensor) / tensor.assign_value(dtensor) / a sparse tensor's values"
        raise ValueError(_NO_COPY.format(what=what).replace("ms.Parameter(dt.to_local())",
                                                            "param.set_data(dt.to_local())"))


# ============================================================================== helpers
_PLACEHOLDERS: dict[Any, Any] = {}
_NO_COPY = ("{what}: a DTensor's own data is an empty placeholder (its shard is dt.to_local()), so this "
            "would silently copy nothing; use dt.to_local() (this rank's shard) or dt.full_tensor() (the "
            "global value), e.g. ms.Parameter(dt.to_local()), or keep the DTensor itself")
NO_COPY = _NO_COPY   # placeholder_reads.py words its errors the same way


def _placeholder(dtype, shape):
    """The data of every DTensor object of ``dtype``: a tensor of unknown rank (shape ``(-2,)``), which
    holds no data. The shard lives in ``_local_tensor``; a MindSpore code path that reads a DTensor's
    own data without asking ``__fallback__`` then fails in the kernel ("Resize failed", "negative
    dimensions are not allowed") instead of silently using an empty tensor (an empty placeholder of
    shape (0,) made ``ops.stack([dt, dt])`` return shape (2, 0), ``ops.addn`` an empty sum and
    ``ms.grad`` with respect to a DTensor an empty gradient). The known entry points of that kind are
    routed or refused with the fix in placeholder_reads.py. A one-element floating DTensor holds a NaN
    of its global shape instead (as ``_ScalarLink`` does while a graph is recorded): MindSpore's JIT
    fallback hands a Python-computed value (e.g. a DTensor loss) through a kernel that needs a static
    shape, and a read elsewhere gives NaN, never a plausible number."""
    key = (dtype, shape if math.prod(shape) == 1 and dtype in _FLOATS else None)
    empty = _PLACEHOLDERS.get(key)
    if empty is None:
        empty = ms.Tensor(dtype=dtype, shape=[-2]) if key[1] is None else \
            ms.Tensor(np.full(shape, np.nan, np.float32), dtype=dtype)
        _PLACEHOLDERS[key] = empty
    return empty


def _records_gradient(local_tensor):
    from mindspore.common.api import _pynative_executor
    return isinstance(local_tensor, ms.Tensor) and local_tensor.dtype in _FLOATS and \
        bool(_pynative_executor.requires_grad())


_FLOATS = (ms.float16, ms.float32, ms.float64, ms.bfloat16)


class _LazyScalarLink:
    """The data of a one-element DTensor made while MindSpore records a graph: a NaN of the global
    shape, computed from the local tensor by a custom Function. ``ms.grad`` / ``value_and_grad``
    differentiate the object a function returns, and a DTensor's own data is otherwise a constant
    placeholder outside the graph, so a returned DTensor loss gave zero gradients. Linked this way,
    the engine's seed (1, or the sens the user passes) reaches the local tensor as the gradient in
    the canonical layout: the whole gradient on every rank for Replicate and Partial (d loss / d
    summand = 1), this rank's piece for Shard. NaN, not the local value: a path that reads the data
    without ``__fallback__`` would otherwise take one rank's summand of a Partial loss as the loss.
    Only one-element DTensors are linked (a custom Function costs ~1 ms in PyNative; losses are
    scalars); a non-scalar DTensor returned to ``ms.grad`` is documented as unsupported."""
    _cls = None

    def apply(self, local, shape):
        if _LazyScalarLink._cls is None:
            _LazyScalarLink._cls = _scalar_link_class()
        return _LazyScalarLink._cls.apply(local, shape)


def _scalar_link_class():
    from mindspore import ops
    from mindspore.common._grad_function import _Function

    class ScalarLink(_Function):
        @staticmethod
        def forward(ctx, local, shape):
            ctx.local_shape, ctx.dtype = tuple(local.shape), local.dtype
            return ops.full(shape, float("nan"), dtype=local.dtype)

        @staticmethod
        def backward(ctx, grad):
            if math.prod(ctx.local_shape) == 0:   # the empty piece of an uneven Shard
                return ops.zeros(ctx.local_shape, ctx.dtype), None
            return grad.reshape(ctx.local_shape).astype(ctx.dtype), None
    return ScalarLink


_ScalarLink = _LazyScalarLink()


class _GetItem:
    """``x[index]`` as core sees it: plain indexing on the local shard, a numpy view for shapes."""

    __name__ = "getitem"

    def __call__(self, x, index):
        if isinstance(x, meta.MetaTensor):
            return meta.getitem(x, index)
        if 0 in tuple(x.shape) or 0 in meta.getitem(meta.MetaTensor(x.shape, x.dtype), index).shape:
            # MindSpore's slice backward fails on empty results ("StridedSliceGrad memcpy failed"):
            # an empty piece has a zero gradient, given explicitly
            return _zero_grad(lambda: ms.Tensor.__getitem__(x, index), x)
        return ms.Tensor.__getitem__(x, index)

    run = __call__


_GETITEM = _GetItem()


def _zero_grad(compute, *tensors):
    from hyper_parallel.platform.mindspore.op_names import _ZeroGrad

    class _Thunk:
        @staticmethod
        def run():
            return compute()
    return _ZeroGrad.apply(_Thunk, (), {}, *tensors)


def _like(func, legacy, name, args, kwargs):
    """zeros_like / ones_like...: the same layout (a Partial source gives a replicated result)."""
    src = args[0]
    local_args = (src._local_tensor,) + tuple(args[1:])
    local = func(legacy, name, local_args) if legacy is not None else func(*local_args, **kwargs)
    return type(src)._make(local, src._hp_grad_spec())


def _replicated(cls, name, op, args, kwargs):
    """No rule: core's replicated fallback (inputs gathered differentiably, Replicate outputs)."""
    return cls._hp_replicated(f"{name} (MindSpore)", op, args, kwargs)


# ============================================================================== parameters
def set_dtensor_parameter(module: Any, name: str, value: Any) -> None:
    """Make ``module.<name>`` the DTensor ``value`` for the Cell's code, while the Cell's parameter
    of that name (what optimizers, ``trainable_params()`` and ``value_and_grad`` see) becomes the
    local shard: a ``mindspore.Parameter`` that is the DTensor's local tensor, so gradients reach it
    and in-place optimizer updates are seen by the next forward."""
    old = module._params.get(name)
    param_name = old.name if old is not None else name
    requires_grad = old.requires_grad if old is not None else True
    param = ms.Parameter(value._local_tensor, name=param_name, requires_grad=requires_grad)
    module._params[name] = param
    view = type(value)._make(param, value._spec, requires_grad=requires_grad)
    object.__setattr__(module, name, view)   # found before Cell.__getattr__ looks in _params
