"""MindSpore primitives for the sharding rules of the ops real models hit (issue 15): prod, argmax,
gather / scatter along a dim, index_select, index_add, flip and the new_* factories -- the same
rules as torch's, with the arguments spelled as torch's (see op_names.py).

Only primitives with a CPU kernel in MindSpore 2.10 are listed, so that each mapping is tested
(tests/cases/ms_model_ops.py). ``mint``'s Addmm, Baddbmm, Addmv, Var / Std / VarMean / StdMean,
LogSumExp, LinalgVectorNorm, ArgMaxExt / ArgMinExt, TopkExt, SortExt / ArgSort, CumsumExt,
MSELossExt, IndexSelect, ScatterAddExt and NewFull have no CPU kernel ("kernel unregistered"):
they are left to the replicated fallback until they can be tested where they run. Also left there:
the legacy TopK / Sort (their axis and order are primitive attributes this table never sees);
Tensor.var's DeprecatedVar (numpy's ddof spelling: its split-dim gradient did not match one
process in a first test, not yet understood); the legacy CumSum (core's prefix-offset scan takes
an empty narrow on the first rank, which MindSpore refuses; an empty slice has no CPU backward).
"""
from hyper_parallel.platform.mindspore import meta
from hyper_parallel.platform.mindspore.op_names import TABLE, _add, _Entry


def _reduced(x, dim=None, keepdim=False, *args, **kwargs):
    return meta.reduction(x, dim, keepdim)


def _int_reduced(x, dim=None, keepdim=False, *args, **kwargs):
    out = meta.reduction(x, dim, keepdim)
    return meta.MetaTensor(out.shape, None)


def _as_input(x, *args, **kwargs):
    return meta.same(x)


def _index_shaped(x, dim, index, *args, **kwargs):
    """gather(x, dim, index): the index's shape."""
    return meta.MetaTensor(tuple(index.shape), x.dtype)


def _selected(x, dim, index, *args, **kwargs):
    """index_select(x, dim, index): dim takes the index's length."""
    d = dim % x.ndim
    return meta.MetaTensor(tuple(x.shape[:d]) + tuple(index.shape) + tuple(x.shape[d + 1:]), x.dtype)


def _new_factory(x, size, *args, **kwargs):
    return meta.MetaTensor(tuple(size), x.dtype)


def _empty_safe(shape_fn, runner=None):
    """``runner`` (None: the operator as called) that returns an empty output of the input's dtype
    without running the kernel when the output is empty: MindSpore's CPU kernels for these
    primitives fail to build or launch on an empty input (an uneven shard's last piece)."""
    def run(invoke, x, *args, **kwargs):
        if 0 in tuple(x.shape):
            metas = [meta.MetaTensor(a.shape, a.dtype) if hasattr(a, "shape") and hasattr(a, "dtype") else a
                     for a in (x,) + args]
            out = shape_fn(*metas, **kwargs)
            if 0 in tuple(out.shape):
                from mindspore import mint
                return mint.zeros(tuple(out.shape), dtype=x.dtype)
        return runner(invoke, x, *args, **kwargs) if runner is not None else invoke(x, *args, **kwargs)
    return run


def _plain_for(shape_fn):
    def normalize(args, kwargs):
        return tuple(args), kwargs, None, _empty_safe(shape_fn), None
    return normalize


def _plain(args, kwargs):
    return tuple(args), kwargs, None, None, None


# prod(x, dim, keepdim, dtype) and gather(x, dim, index): already torch's order
_add("ProdExt", "prod", _reduced, "prod", _plain)
_add("GatherD", "gather", _index_shaped, "gather", _plain_for(_index_shaped))
_add("ReverseV2", "flip", _as_input, "flip", _plain_for(_as_input))
_add("NewZeros", "new_factory", _new_factory, "new_zeros", _plain)
_add("NewOnes", "new_factory", _new_factory, "new_ones", _plain)
_add("NewEmpty", "new_factory", _new_factory, "new_empty", _plain)


def _scatter(args, kwargs):
    """Scatter(x, dim, index, src, reduce): reduce 0 is a plain scatter (torch.scatter)."""
    if len(args) != 5 or args[4] != 0:
        return None

    def runner(invoke, x, dim, index, src):
        return invoke(x, dim, index, src, 0)
    return tuple(args[:4]), {}, None, _empty_safe(_as_input, runner), 0


TABLE["Scatter"] = _Entry("scatter", "scatter", lambda x, *a, **k: meta.same(x), _scatter)


def _legacy_argmax(args, kwargs):
    """ops.argmax's primitive: Argmax(x, axis, output_type) -> argmax(x, dim)."""
    if len(args) != 3 or not isinstance(args[1], int):
        return None
    output_type = args[2]

    def runner(invoke, x, dim):
        if 0 in tuple(x.shape):   # an empty (uneven) piece: MindSpore cannot build the kernel
            from mindspore import mint
            probe = invoke(mint.zeros((1,) * x.ndim, dtype=x.dtype), dim, output_type)
            shape = tuple(s for d, s in enumerate(x.shape) if d != dim % x.ndim)
            return mint.zeros(shape, dtype=probe.dtype)
        return invoke(x, dim, output_type)
    return (args[0], args[1]), {}, None, runner, output_type


TABLE["Argmax"] = _Entry("argmax", "argmax", _int_reduced, _legacy_argmax)


def _gather_select(args, kwargs):
    """Gather(params, indices, axis, batch_dims) with a 1-D index is index_select(x, axis, index)
    (axis 0 of a 2-D table is the embedding lookup of op_names.py, which keeps that entry)."""
    params, indices = args[0], args[1]
    axis = args[2] if len(args) > 2 else kwargs.get("axis", 0)
    batch_dims = args[3] if len(args) > 3 else kwargs.get("batch_dims", 0)
    if batch_dims or getattr(indices, "ndim", 0) != 1 or not isinstance(axis, int):
        return None

    def runner(invoke, x, dim, index):
        return invoke(x, index, dim, 0)
    return (params, axis, indices), {}, "index_select", _empty_safe(_selected, runner), ("select", axis), \
        _selected


def _index_add(args, kwargs):
    """IndexAddExt(x, dim, index, source, alpha) -> index_add(x, dim, index, source, alpha=)."""
    if len(args) < 4:
        return None
    alpha = args[4] if len(args) > 4 else kwargs.get("alpha", 1)

    def runner(invoke, x, dim, index, source, alpha=1):
        return invoke(x, dim, index, source, alpha=alpha)
    return tuple(args[:4]), {"alpha": alpha}, None, _empty_safe(_as_input, runner), None


TABLE["IndexAddExt"] = _Entry("index_add", "index_add", lambda x, *a, **k: meta.same(x), _index_add)


_embedding_lookup = TABLE["Gather"].normalize


def _gather(args, kwargs):
    """Gather: the embedding lookup of op_names.py where it applies, index_select otherwise."""
    return _embedding_lookup(args, kwargs) or _gather_select(args, kwargs)


TABLE["Gather"] = _Entry("embedding", "embedding", TABLE["Gather"].shape_fn, _gather)

__all__ = []
