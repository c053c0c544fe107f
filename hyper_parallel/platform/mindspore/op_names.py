"""MindSpore operators on DTensors -> core's framework-neutral op names and torch-style arguments.

A DTensor's ``__fallback__`` (``dtensor_base.py``) receives MindSpore's operator object (an
``OpCall`` whose ``name`` is the primitive, e.g. ``MatMulExt``, ``Softmax``, ``TransposeExtView``)
and its parsed arguments. This table says which sharding rule each primitive meets ("matmul",
"softmax", "transpose", "elementwise"...), how to spell its arguments the way that rule reads them
(the rules are written against torch's signatures: ``softmax(x, dim)``, ``sum(x, dim, keepdim)``,
``transpose(x, dim0, dim1)``...), and the shape function that stands in for a meta-device run.

What core receives as ``func`` is an :class:`MsOp`: called with local MindSpore tensors it runs
the MindSpore operator; called with :class:`~meta.MetaTensor` arguments it returns the output
shapes. Its ``__name__`` is a torch-like name ("add", "mul", "div"...), which the elementwise rule
reads to decide whether a Partial input may stay Partial.

Primitives not listed run through the replicated fallback (a warning names them; with
``HP_STRICT_DISPATCH=1`` they raise).
"""
from typing import Any
from hyper_parallel.platform.mindspore import meta


class MsOp:
    """A MindSpore operator as core sees it (see the module docstring).

    ``runner(invoke, *args, **kwargs)``, when given, maps the torch-style arguments back to the
    operator's own (``invoke(*raw_args)`` calls it); ``legacy`` is the Primitive of an old-style
    operator, which is called as ``op(primitive, name, args)``. ``key`` identifies the call
    pattern (for core's shape cache)."""

    __slots__ = ("op", "__name__", "shape_fn", "ms_name", "legacy", "runner", "key")

    def __init__(self, op: Any, display: Any, shape_fn: Any, ms_name: str, legacy: Any = None,
                 runner: Any = None, key: Any = None) -> None:
        self.op, self.__name__, self.shape_fn, self.ms_name = op, display, shape_fn, ms_name
        self.legacy, self.runner, self.key = legacy, runner, key

    def invoke(self, *args: Any, **kwargs: Any) -> Any:
        if self.legacy is not None:
            return self.op(self.legacy, self.ms_name, tuple(args))
        return self.op(*args, **kwargs)

    def __call__(self, *args, **kwargs):
        if meta.any_meta(args, kwargs):
            return self.shape_fn(*args, **kwargs)
        if self.shape_fn is not None and _has_empty(args):
            return _empty_safe(self, args, kwargs)
        return self.run(*args, **kwargs)

    def run(self, *args: Any, **kwargs: Any) -> Any:
        if self.runner is not None:
            return self.runner(self.invoke, *args, **kwargs)
        return self.invoke(*args, **kwargs)

    def __hash__(self):
        return hash((self.ms_name, self.__name__, self.key))

    def __eq__(self, other):
        return isinstance(other, MsOp) and (self.ms_name, self.__name__, self.key) == \
            (other.ms_name, other.__name__, other.key)

    def __repr__(self):
        return f"MsOp({self.ms_name} as {self.__name__})"


# ------------------------------------------------------------------------------ empty shards
def _tensors(args):
    import mindspore as ms
    out = []
    for a in args:
        if isinstance(a, ms.Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out.extend(b for b in a if isinstance(b, ms.Tensor))
    return out


def _has_empty(args):
    return any(0 in tuple(t.shape) for t in _tensors(args))


def _empty_safe(op, args, kwargs):
    """An op with an empty local input (an uneven shard) whose outputs are all empty, a matmul
    whose contraction is empty, or a reduction of an empty input: the outputs do not depend on the
    input values, so every input gradient is zero. MindSpore's engine may then skip the backward of
    the ops that produced the inputs (it does for matmul), while the other ranks run the
    collectives in those backwards -- a deadlock. This custom function returns explicit zero
    gradients instead, which keeps every rank's backward running the same collectives.

    MindSpore's CPU reduction kernels (ReduceSum, mean, prod, max/min...) and matmul leave their
    output UNINITIALISED when the input is empty -- it holds whatever the memory pool last put
    there (often an earlier result) instead of the reduction's identity. An empty piece of an
    uneven Shard reduced by the sum rule then adds garbage to the Partial sum: a silent wrong
    result. Such outputs are therefore filled here: sum 0, mean NaN, prod 1 (as torch); max / min
    of an empty input raise, as torch does (core's amax / amin rule gathers a dim with an empty
    piece, so only a globally empty input gets there). Other ops with empty inputs run as they
    are."""
    shapes = op.shape_fn(*_to_meta(args), **kwargs)
    outs = shapes if isinstance(shapes, (tuple, list)) else (shapes,)
    all_empty = all(0 in o.shape for o in outs if isinstance(o, meta.MetaTensor))
    first = args[0] if args and _is_ms_tensor(args[0]) else None
    contraction = op.ms_name in _MATMULS and first is not None and first.shape and first.shape[-1] == 0
    if not all_empty and first is not None and 0 in tuple(first.shape):
        if op.ms_name in _EMPTY_REDUCTION_ERRORS:
            raise IndexError(f"{op.ms_name}: reduction of an empty tensor (shape {tuple(first.shape)}) "
                             f"has no identity (torch raises too)")
        if op.ms_name in _EMPTY_REDUCTION_FILL:
            filled = _Filled(op, _EMPTY_REDUCTION_FILL[op.ms_name])
            return _ZeroGrad.apply(filled, args, kwargs, *_tensors(args))
    if not (all_empty or contraction):
        return op.run(*args, **kwargs)
    return _ZeroGrad.apply(op, args, kwargs, *_tensors(args))


class _Filled:
    """``op`` on an empty input: its outputs' shapes and dtypes, filled with ``value``."""

    def __init__(self, op, value):
        self.op, self.value = op, value

    def run(self, *args, **kwargs):
        from mindspore import ops
        out = self.op.run(*args, **kwargs)
        if isinstance(out, (tuple, list)):
            return type(out)(ops.full_like(o, self.value) for o in out)
        return ops.full_like(out, self.value)


# what a reduction of an empty input gives (torch's values); MindSpore's kernels leave it unset
_EMPTY_REDUCTION_FILL = {"SumExt": 0, "ReduceSum": 0, "MeanExt": float("nan"), "ReduceMean": float("nan"),
                         "ProdExt": 1, "ReduceProd": 1}
_EMPTY_REDUCTION_ERRORS = {"ReduceMax", "AmaxExt", "ReduceMin", "AminExt", "Max", "MaxDim", "Min", "MinDim",
                           "ArgMaxExt", "Argmax", "ArgMinExt", "Argmin"}


def _to_meta(args):
    out = []
    for a in args:
        if _is_ms_tensor(a):
            out.append(meta.MetaTensor(a.shape, a.dtype))
        elif isinstance(a, (list, tuple)):
            out.append(type(a)(meta.MetaTensor(b.shape, b.dtype) if _is_ms_tensor(b) else b for b in a))
        else:
            out.append(a)
    return out


def _is_ms_tensor(x):
    import mindspore as ms
    return isinstance(x, ms.Tensor)


def _zero_grad_class():
    from mindspore import ops
    from mindspore.common._grad_function import _Function

    class ZeroGrad(_Function):
        @staticmethod
        def forward(ctx, op, args, kwargs, *tensors):
            ctx.tensors = tensors
            return op.run(*args, **kwargs)

        @staticmethod
        def backward(ctx, *grads):
            return (None, None, None) + tuple(ops.zeros_like(t) for t in ctx.tensors)
    return ZeroGrad


class _LazyZeroGrad:
    _cls = None

    def apply(self, *args):
        if _LazyZeroGrad._cls is None:
            _LazyZeroGrad._cls = _zero_grad_class()
        return _LazyZeroGrad._cls.apply(*args)


_ZeroGrad = _LazyZeroGrad()
_MATMULS = {"MatMulExt", "BatchMatMulExt", "Mm", "Bmm", "MatMul", "BatchMatMul", "Dense"}


class _TensorSum:
    """``Tensor.sum`` as an op for :class:`_Filled` (core reduces raw local pieces with it)."""

    @staticmethod
    def run(tensor, dim=None, keepdim=False):
        return tensor.sum(dim=dim, keepdim=keepdim)


def local_sum(tensor: Any, dim: Any = None, keepdim: bool = False) -> Any:
    """``tensor.sum(dim=dim, keepdim=keepdim)``, safe on an empty tensor: the kernel's output
    (right shape and dtype, uninitialised values) is filled with 0 inside the zero-gradient
    Function, as ``_empty_safe`` does for the SumExt / ReduceSum of the op table. Core's rules
    call it (``platform.local_sum``) where they reduce a raw local piece themselves."""
    if 0 not in tuple(tensor.shape):
        return tensor.sum(dim=dim, keepdim=keepdim)
    return _ZeroGrad.apply(_Filled(_TensorSum, 0), (tensor,), {"dim": dim, "keepdim": keepdim}, tensor)


class _Entry:
    """``normalize(args, kwargs)`` -> None (no rule: fallback) or (args, kwargs, neutral name or
    None, runner or None, key[, shape function]): torch-style arguments, and how to call the
    operator with them."""
    __slots__ = ("neutral", "display", "shape_fn", "normalize")

    def __init__(self, neutral, display, shape_fn, normalize=None):
        self.neutral, self.display, self.shape_fn, self.normalize = neutral, display, shape_fn, normalize


TABLE = {}


def _add(names, neutral, shape_fn, display=None, normalize=None):
    for name in names.split():
        TABLE[name] = _Entry(neutral, display or name.lower(), shape_fn, normalize)


# ------------------------------------------------------------------------------ elementwise
_UNARY = ("Abs Exp Exp2 Expm1 Log Log1p Log2 Sqrt Rsqrt Square Sin Cos Tan Tanh Sigmoid ReLU ReLU6 SiLU "
          "GeLU GeluExt FastGeLU Erf Erfc Sign Floor Ceil Round Trunc LogicalNot IsNan IsInf IsFinite "
          "NanToNum Reciprocal Softplus SoftplusExt LeakyReLUExt Elu EluExt Mish HSwish HSigmoid "
          "BitwiseNot Atan Asin Acos Sinh Cosh Asinh Acosh Atanh ClampScalar ClampTensor")
_add(_UNARY, "elementwise", meta.elementwise)
_add("Neg", "elementwise", meta.elementwise, "neg")
_add("AddExt AddScalar Add", "elementwise", meta.elementwise, "add")
_add("SubExt SubScalar Sub", "elementwise", meta.elementwise, "sub")
_add("Mul Muls", "elementwise", meta.elementwise, "mul")
_add("Div Divs RealDiv DivMod DivMods", "elementwise", meta.elementwise, "div")
_add("FloorDiv FloorDivScalar Pow PowTensorScalar PowScalarTensor Maximum Minimum Less LessEqual Greater "
     "GreaterEqual Equal NotEqual BitwiseAndTensor BitwiseAndScalar BitwiseOrTensor BitwiseOrScalar "
     "BitwiseXorTensor BitwiseXorScalar LogicalAnd LogicalOr LogicalXor RemainderTensorScalar "
     "RemainderTensorTensor RemainderScalarTensor Atan2 Atan2Ext Lerp LerpScalar Xlogy IsClose",
     "elementwise", meta.elementwise)
_add("Select", "elementwise", meta.elementwise, "where")
_add("MaskedFill MaskedFillScalar", "elementwise", meta.elementwise, "masked_fill")


def _bias_add(args, kwargs):
    """BiasAdd(x, b, data_format): the channel dim of a 2-D input is its last: a broadcast add."""
    if len(args) >= 2 and getattr(args[0], "ndim", 0) == 2:
        rest = tuple(args[2:])
        return (args[0], args[1]), kwargs, None, (lambda invoke, x, b, **kw: invoke(x, b, *rest, **kw)), rest
    return None


_add("BiasAdd", "elementwise", meta.elementwise, "add", _bias_add)


# ------------------------------------------------------------------------------ matmul / linear
def _empty_contraction(shape_fn, *args):
    """MindSpore's CPU matmul kernels may return uninitialised memory (not zeros) when the
    contraction dim is empty -- which an uneven shard can be. The product is then zeros. (It runs
    inside ``_empty_safe``'s zero-gradient Function, which keeps the empty inputs in the autograd
    graph; no ``a.sum() * 0`` link: the sum of an empty tensor is uninitialised too, and a NaN or
    inf there would poison the product.)"""
    import mindspore as ms
    from mindspore import mint
    metas = [meta.MetaTensor(a.shape, a.dtype) if isinstance(a, ms.Tensor) else a for a in args]
    return mint.zeros(shape_fn(*metas).shape, dtype=args[0].dtype)


def _matmul_runner(invoke, a, b, *rest, **kwargs):
    if a.shape and a.shape[-1] == 0:
        return _empty_contraction(meta.matmul, a, b)
    return invoke(a, b, *rest, **kwargs)


def _linear_runner(invoke, x, w, bias=None, *rest, **kwargs):
    if x.shape and x.shape[-1] == 0:
        out = _empty_contraction(meta.linear, x, w)
        return out + bias if bias is not None else out
    return invoke(x, w, bias, *rest, **kwargs)


def _plain(runner):
    def normalize(args, kwargs):
        return tuple(args), kwargs, None, runner, None
    return normalize


_add("MatMulExt BatchMatMulExt Mm Bmm", "matmul", meta.matmul, normalize=_plain(_matmul_runner))
_add("Dense", "linear", meta.linear, normalize=_plain(_linear_runner))


def _legacy_matmul(args, kwargs):
    """MatMul / BatchMatMul(a, b, transpose_a, transpose_b) as matmul (no transposes) or linear
    (nn.Dense's transpose_b); a transposed A has no rule."""
    a, b = args[0], args[1]
    ta = bool(args[2]) if len(args) > 2 else bool(kwargs.get("transpose_a", False))
    tb = bool(args[3]) if len(args) > 3 else bool(kwargs.get("transpose_b", False))
    if ta or (tb and getattr(b, "ndim", 0) != 2):
        return None

    def runner(invoke, x, y):
        if x.shape and x.shape[-1] == 0:
            return _empty_contraction(meta.linear if tb else meta.matmul, x, y)
        return invoke(x, y, ta, tb)
    return (a, b), {}, ("linear" if tb else "matmul"), runner, (ta, tb), (meta.linear if tb else meta.matmul)


TABLE["MatMul"] = _Entry("matmul", "matmul", meta.matmul, _legacy_matmul)
TABLE["BatchMatMul"] = _Entry("matmul", "matmul", meta.matmul, _legacy_matmul)

# ------------------------------------------------------------------------------ views
_add("Reshape View", "view", meta.reshape, "reshape")
_add("FlattenExt", "view", meta.flatten, "flatten")
_add("ExpandDims Unsqueeze", "view", meta.unsqueeze, "unsqueeze")
_add("Squeeze", "view", meta.squeeze, "squeeze")
TABLE["ViewAs"] = _Entry("view", "view_as", lambda x, other, *a, **k: meta.MetaTensor(other.shape, x.dtype))
_add("BroadcastTo ExpandAs Expand", "expand", meta.expand, "expand")
_add("TransposeExtView TransposeExt Swapaxes", "transpose", meta.transpose, "transpose")
_add("Transpose TransposeView Permute", "permute", meta.permute, "permute")
_add("TExt", "t", meta.t, "t")
_add("Clone Contiguous StopGradient Identity", "identity", meta.same)
_add("ToDtype Cast", "cast", meta.same)

# ------------------------------------------------------------------------------ split / cat
_add("Concat Cat", "cat", meta.cat, "cat")
_add("StackExt Stack", "stack", meta.stack, "stack")
_add("SplitTensor SplitTensorView SplitWithSize SplitWithSizeView", "split", meta.split, "split")
_add("Chunk ChunkView", "chunk", meta.chunk, "chunk")
_add("Narrow NarrowView", "narrow", meta.narrow, "narrow")
_add("UnstackExtView UnstackExt Unbind", "unbind", meta.unbind, "unbind")

# ------------------------------------------------------------------------------ softmax, reductions


def _one_dim(args, kwargs):
    """softmax(x, (d,)) -> softmax(x, d)."""
    args = list(args)
    if len(args) > 1 and isinstance(args[1], (tuple, list)):
        if len(args[1]) != 1:
            return None
        args[1] = args[1][0]
    return tuple(args), kwargs, None, None, None


_add("Softmax LogSoftmax LogSoftmaxExt SoftmaxExt", "softmax", meta.same, "softmax", _one_dim)
_add("SumExt ReduceSum", "sum", meta.reduction, "sum")
_add("MeanExt ReduceMean", "mean", meta.reduction, "mean")
_add("ReduceMax AmaxExt", "amax", meta.reduction, "amax")
_add("ReduceMin AminExt", "amin", meta.reduction, "amin")
_add("Max MaxDim", "max", meta.max_with_dim, "max")
_add("Min MinDim", "min", meta.max_with_dim, "min")

# ------------------------------------------------------------------------------ nn functions
_add("LayerNormExt", "layer_norm", lambda x, *a, **k: meta.same(x), "layer_norm")
_add("FuncDropoutExt DropoutExt", "dropout", lambda x, *a, **k: meta.same(x), "dropout")


def _legacy_dropout(args, kwargs):
    """ops.dropout's primitive: Dropout(x, keep_prob, seed0, seed1) -> (out, mask)."""
    x, keep = args[0], float(args[1]) if len(args) > 1 else 0.5
    seeds = tuple(args[2:])

    def runner(invoke, x, p, training):
        return invoke(x, keep, *seeds)
    return (x, 1.0 - keep, True), {}, None, runner, (keep,) + seeds


TABLE["Dropout"] = _Entry("dropout", "dropout", lambda x, *a, **k: (meta.same(x), meta.same(x)),
                          _legacy_dropout)


def _embedding_shape(ids, weight, *args, **kwargs):
    return meta.MetaTensor(tuple(ids.shape) + (weight.shape[1],), weight.dtype)


def _gather_as_embedding(args, kwargs):
    """Gather(params, indices, axis[, batch_dims]) with axis 0 of a 2-D table is an embedding
    lookup (what nn.Embedding and ops.gather(table, ids, 0) do; mint's Embedding kernel is not on
    CPU): embedding(ids, weight). Other gathers have no rule."""
    params, indices = args[0], args[1]
    axis = args[2] if len(args) > 2 else kwargs.get("axis", 0)
    batch_dims = args[3] if len(args) > 3 else kwargs.get("batch_dims", 0)
    if getattr(params, "ndim", 0) != 2 or axis not in (0, -2) or batch_dims:
        return None
    rest = tuple(args[2:])

    def runner(invoke, ids, weight, padding_idx=None, max_norm=None, norm_type=2.0, scale_grad_by_freq=False,
               sparse=False):
        # the rule passes torch's F.embedding arguments; a Gather never has a padding_idx to pass on
        return invoke(weight, ids, *rest)
    return (indices, params), {}, "embedding", runner, rest, _embedding_shape


TABLE["Gather"] = _Entry("embedding", "embedding", _embedding_shape, _gather_as_embedding)


def lookup(name: str) -> Any:
    return TABLE.get(name)


__all__ = ["MsOp", "TABLE", "lookup"]
