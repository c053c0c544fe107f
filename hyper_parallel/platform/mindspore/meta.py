"""Output shapes without running the op: MindSpore has no "meta" device.

Core learns the global output shapes of an op on DTensors by calling the op on meta tensors
(``dispatch.meta_outputs``). On MindSpore those are :class:`MetaTensor` (shape and dtype only) and
every op in the table of ``op_names.py`` comes with a shape function here, written against the
torch-style arguments that table hands to core. Basic indexing is evaluated on a zero-stride numpy
view (no memory); an op without a shape function raises, and the dispatcher then takes the
replicated fallback.
"""
from typing import Any
import math

import numpy as np


class MetaTensor:
    """Shape and dtype of a tensor that has no data."""

    __slots__ = ("shape", "dtype")

    def __init__(self, shape: Any, dtype: Any) -> None:
        self.shape = tuple(int(s) for s in shape)
        self.dtype = dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def dim(self) -> int:
        return len(self.shape)

    def numel(self) -> Any:
        return math.prod(self.shape)

    def __repr__(self):
        return f"MetaTensor({self.shape}, {self.dtype})"


def is_meta(x: Any) -> bool:
    return isinstance(x, MetaTensor)


def any_meta(args: Any, kwargs: Any) -> bool:
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, MetaTensor):
            return True
        if isinstance(a, (list, tuple)) and any(isinstance(b, MetaTensor) for b in a):
            return True
    return False


def _first(args):
    for a in args:
        if isinstance(a, MetaTensor):
            return a
        if isinstance(a, (list, tuple)):
            for b in a:
                if isinstance(b, MetaTensor):
                    return b
    raise ValueError("no tensor argument")


def _shape_arg(rest):
    if len(rest) == 1 and isinstance(rest[0], (list, tuple)):
        return tuple(rest[0])
    return tuple(rest)


def _resolve(shape, numel):
    shape = [int(s) for s in shape]
    if -1 in shape:
        known = math.prod(s for s in shape if s != -1)
        shape[shape.index(-1)] = numel // known if known else 0
    return tuple(shape)


def _norm(d, ndim):
    return d % ndim if ndim else 0


def _meta(shape, like):
    return MetaTensor(shape, like.dtype)


# =============================================================================== shape functions
def same(x: Any, *args: Any, **kwargs: Any) -> Any:
    x = _first((x,) + args)
    return _meta(x.shape, x)


def elementwise(*args: Any, **kwargs: Any) -> Any:
    tensors = [a for a in list(args) + list(kwargs.values()) if isinstance(a, MetaTensor)]
    shape = np.broadcast_shapes(*[t.shape for t in tensors]) if tensors else ()
    return _meta(shape, tensors[0])


def matmul(a: Any, b: Any, *args: Any, **kwargs: Any) -> Any:
    sa, sb = a.shape, b.shape
    if len(sa) == 1 and len(sb) == 1:
        return _meta((), a)
    if len(sb) == 1:
        return _meta(sa[:-1], a)
    if len(sa) == 1:
        return _meta(sb[:-2] + sb[-1:], a)
    batch = np.broadcast_shapes(sa[:-2], sb[:-2])
    return _meta(tuple(batch) + (sa[-2], sb[-1]), a)


def linear(x: Any, w: Any, *args: Any, **kwargs: Any) -> Any:
    return _meta(x.shape[:-1] + (w.shape[0],), x)


def reshape(x: Any, *shape: Any, **kwargs: Any) -> Any:
    shape = _shape_arg(shape) if shape else tuple(kwargs["shape"])
    return _meta(_resolve(shape, x.numel()), x)


def flatten(x: Any, start_dim: int = 0, end_dim: Any = -1, *args: Any, **kwargs: Any) -> Any:
    if x.ndim == 0:
        return _meta((1,), x)
    s, e = _norm(start_dim, x.ndim), _norm(end_dim, x.ndim)
    return _meta(x.shape[:s] + (math.prod(x.shape[s:e + 1]),) + x.shape[e + 1:], x)


def unsqueeze(x: Any, dim: Any, *args: Any, **kwargs: Any) -> Any:
    d = dim % (x.ndim + 1)
    return _meta(x.shape[:d] + (1,) + x.shape[d:], x)


def squeeze(x: Any, dim: Any = None, *args: Any, **kwargs: Any) -> Any:
    if dim is None or (isinstance(dim, (tuple, list)) and len(dim) == 0):
        return _meta(tuple(s for s in x.shape if s != 1), x)
    dims = {d % x.ndim for d in (dim if isinstance(dim, (tuple, list)) else (dim,))}
    return _meta(tuple(s for i, s in enumerate(x.shape) if not (i in dims and s == 1)), x)


def transpose(x: Any, dim0: Any, dim1: Any, *args: Any, **kwargs: Any) -> Any:
    shape = list(x.shape)
    a, b = _norm(dim0, x.ndim), _norm(dim1, x.ndim)
    shape[a], shape[b] = shape[b], shape[a]
    return _meta(tuple(shape), x)


def permute(x: Any, *dims: Any, **kwargs: Any) -> Any:
    dims = _shape_arg(dims) if dims else tuple(kwargs["dims"])
    return _meta(tuple(x.shape[_norm(d, x.ndim)] for d in dims), x)


def t(x: Any, *args: Any, **kwargs: Any) -> Any:
    return _meta(x.shape[::-1] if x.ndim == 2 else x.shape, x)


def expand(x: Any, *shape: Any, **kwargs: Any) -> Any:
    shape = _shape_arg(shape) if shape else tuple(kwargs["size"])
    lead = len(shape) - x.ndim
    out = [s if s != -1 else x.shape[i - lead] for i, s in enumerate(shape)]
    return _meta(tuple(out), x)


def reduction(x: Any, dim: Any = None, keepdim: bool = False, *args: Any, **kwargs: Any) -> Any:
    dim = kwargs.get("dim", kwargs.get("axis", dim))
    keepdim = bool(kwargs.get("keepdim", kwargs.get("keep_dims", keepdim)))
    if dim is None or (isinstance(dim, (tuple, list)) and len(dim) == 0):
        dims = set(range(x.ndim))
    else:
        dims = {_norm(d, x.ndim) for d in (dim if isinstance(dim, (tuple, list)) else (dim,))}
    shape = tuple((1 if i in dims else s) for i, s in enumerate(x.shape) if keepdim or i not in dims)
    return _meta(shape, x)


def max_with_dim(x: Any, dim: Any = None, keepdim: bool = False, *args: Any, **kwargs: Any) -> Any:
    """max(x) -> one value; max(x, dim, keepdim) -> (values, indices)."""
    dim = kwargs.get("dim", dim)
    if dim is None:
        return _meta((), x)
    values = reduction(x, dim, keepdim)
    return values, MetaTensor(values.shape, None)


def cat(tensors: Any, dim: int = 0, *args: Any, **kwargs: Any) -> Any:
    tensors = [x for x in tensors if isinstance(x, MetaTensor)]
    nonempty = [x for x in tensors if not (x.ndim == 1 and x.shape[0] == 0)] or tensors
    ref = nonempty[0]
    d = _norm(kwargs.get("dim", kwargs.get("axis", dim)), ref.ndim)
    shape = list(ref.shape)
    shape[d] = sum(x.shape[d] for x in nonempty)
    return _meta(tuple(shape), ref)


def stack(tensors: Any, dim: int = 0, *args: Any, **kwargs: Any) -> Any:
    ref = tensors[0]
    d = kwargs.get("dim", kwargs.get("axis", dim)) % (ref.ndim + 1)
    return _meta(ref.shape[:d] + (len(tensors),) + ref.shape[d:], ref)


def _pieces(x, dim, sizes):
    out = []
    for s in sizes:
        shape = list(x.shape)
        shape[dim] = s
        out.append(_meta(tuple(shape), x))
    return tuple(out)


def split(x: Any, split_size_or_sections: Any, dim: int = 0, *args: Any, **kwargs: Any) -> Any:
    d = _norm(kwargs.get("dim", kwargs.get("axis", dim)), x.ndim)
    length = x.shape[d]
    if isinstance(split_size_or_sections, int):
        step = split_size_or_sections
        sizes = [min(step, length - i) for i in range(0, length, step)] if length else [0]
    else:
        sizes = list(split_size_or_sections)
    return _pieces(x, d, sizes)


def chunk(x: Any, chunks: Any, dim: int = 0, *args: Any, **kwargs: Any) -> Any:
    d = _norm(kwargs.get("dim", dim), x.ndim)
    length = x.shape[d]
    step = -(-length // chunks) if length else 0
    sizes = [min(step, length - i) for i in range(0, length, step)] if step else [0]
    return _pieces(x, d, sizes)


def unbind(x: Any, dim: int = 0, *args: Any, **kwargs: Any) -> Any:
    d = _norm(dim, x.ndim)
    return tuple(_meta(x.shape[:d] + x.shape[d + 1:], x) for _ in range(x.shape[d]))


def narrow(x: Any, dim: Any, start: Any, length: Any, *args: Any, **kwargs: Any) -> Any:
    shape = list(x.shape)
    shape[_norm(dim, x.ndim)] = int(length)
    return _meta(tuple(shape), x)


def getitem(x: Any, index: Any, *args: Any, **kwargs: Any) -> Any:
    zero = np.broadcast_to(np.zeros((), np.float32), x.shape)
    index = tuple(_np_index(i) for i in index) if isinstance(index, tuple) else _np_index(index)
    return _meta(zero[index].shape, x)


def _np_index(i):
    if isinstance(i, MetaTensor):
        raise TypeError("tensor indices have no shape function")
    return i


def sdpa(q: Any, k: Any, v: Any, *args: Any, **kwargs: Any) -> Any:
    return _meta(q.shape[:-1] + v.shape[-1:], q)


def embedding(ids: Any, weight: Any, *args: Any, **kwargs: Any) -> Any:
    return _meta(ids.shape + weight.shape[-1:], weight)


def cross_entropy(x: Any, target: Any, *args: Any, **kwargs: Any) -> Any:
    reduction_ = kwargs.get("reduction", args[3] if len(args) > 3 else "mean")
    if reduction_ == "none":
        return _meta(target.shape if target.ndim < x.ndim else x.shape[:1] + x.shape[2:], x)
    return _meta((), x)
