"""Attention on MindSpore: scaled dot-product attention with PyTorch's semantics.

MindSpore has no ``scaled_dot_product_attention`` (``ops.flash_attention_score`` is Ascend-only),
so model code on MindSpore calls :func:`scaled_dot_product_attention` from here (also exported as
``hyper_parallel.platform.mindspore.scaled_dot_product_attention``). On plain tensors it computes
``softmax(q k^T * scale + mask) v`` with MindSpore ops (differentiable by MindSpore's autograd); on
DTensors it is core's "sdpa" op, so its sharding rule applies -- including the global causal
offset of all-gather-KV context parallelism. Tensors are (..., heads, seq, dim).

Masks follow PyTorch: a boolean ``attn_mask`` is True where attention is allowed, a float mask is
added to the scores; ``is_causal`` is the top-left aligned lower triangle (query i sees keys
j <= i).
"""
from typing import Any
import math

import mindspore as ms
from mindspore import mint, ops

from hyper_parallel.platform.mindspore import meta


def sdpa(q: Any, k: Any, v: Any, attn_mask: Any = None, dropout_p: float = 0.0, is_causal: bool = False,
         scale: Any = None, enable_gqa: bool = False) -> Any:
    """The math on local (plain) tensors."""
    d = q.shape[-1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    if enable_gqa and k.shape[-3] != q.shape[-3]:
        groups = q.shape[-3] // k.shape[-3]
        k = ops.repeat_interleave(k, groups, axis=k.ndim - 3)
        v = ops.repeat_interleave(v, groups, axis=v.ndim - 3)
    scores = ops.matmul(q, k.swapaxes(-1, -2)) * scale
    rows, cols = q.shape[-2], k.shape[-2]
    if is_causal:
        keep = ops.tril(mint.ones((rows, cols), dtype=ms.int32)).astype(ms.bool_)
        scores = scores.masked_fill(~keep, float("-inf"))
    if attn_mask is not None:
        if attn_mask.dtype == ms.bool_:
            scores = scores.masked_fill(~attn_mask, float("-inf"))
        else:
            scores = scores + attn_mask
    weights = ops.softmax(scores, -1)
    if dropout_p:
        weights = ops.dropout(weights, p=dropout_p)
    return ops.matmul(weights, v)


class _Sdpa:
    """``scaled_dot_product_attention`` as core sees it: runs :func:`sdpa` on local tensors,
    gives the output shape on meta tensors."""

    __name__ = "scaled_dot_product_attention"

    def __call__(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                 enable_gqa=False):
        if isinstance(query, meta.MetaTensor):
            return meta.sdpa(query, key, value)
        return sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


_SDPA = _Sdpa()


def scaled_dot_product_attention(query: Any, key: Any, value: Any, attn_mask: Any = None,
                                 dropout_p: float = 0.0, is_causal: bool = False, scale: Any = None,
                                 enable_gqa: bool = False) -> Any:
    """PyTorch's ``F.scaled_dot_product_attention`` for MindSpore tensors and DTensors."""
    from hyper_parallel.platform.mindspore.dtensor_base import MindSporeDTensorBase, _replicated
    args = (query, key, value)
    kwargs = {"attn_mask": attn_mask, "dropout_p": dropout_p, "is_causal": is_causal, "scale": scale}
    if enable_gqa:
        kwargs["enable_gqa"] = True
    dtensors = [x for x in args + (attn_mask,) if isinstance(x, MindSporeDTensorBase)]
    if not dtensors:
        return _SDPA(*args, **kwargs)
    cls = type(dtensors[0])
    result = cls._hp_function("sdpa", _SDPA, args, kwargs)
    if result is NotImplemented:
        return _replicated(cls, "scaled_dot_product_attention", _SDPA, args, kwargs)
    return result


# ------------------------------------------------------------------------------ ring kernels
def _scores(q, k, causal, scale, mask=None, softcap=None):
    """(masked scores, scale, tanh of the soft-capped scores or None: Gemma 2's c·tanh(s / c))."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = ops.matmul(q.astype(ms.float32), k.astype(ms.float32).swapaxes(-1, -2)) * scale
    capped = None
    if softcap:
        capped = ops.tanh(s / softcap)
        s = capped * softcap
    if causal:
        keep = ops.tril(mint.ones(tuple(s.shape[-2:]), dtype=ms.int32)).astype(ms.bool_)
        s = s.masked_fill(~keep, float("-inf"))
    if mask is not None:   # boolean, True where attention is allowed
        s = s.masked_fill(~mask, float("-inf"))
    return s, scale, capped


def block_forward(q: Any, k: Any, v: Any, causal: bool = False, scale: Any = None, mask: Any = None,
                  softcap: Any = None) -> Any:
    """(out, float32 log-sum-exp) of attention over one key block (batch, heads, seq, dim)."""
    s, _, _ = _scores(q, k, causal, scale, mask, softcap)
    lse = ops.logsumexp(s, -1)
    out = ops.matmul(ops.exp(s - lse.unsqueeze(-1)), v.astype(ms.float32))
    return out.astype(q.dtype), lse


def block_backward(grad_out: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, causal: bool = False,
                   scale: Any = None, mask: Any = None, softcap: Any = None) -> Any:
    """(dq, dk, dv) of one key block, given the row's final output and log-sum-exp."""
    s, scale, capped = _scores(q, k, causal, scale, mask, softcap)
    p = ops.exp(s - lse.unsqueeze(-1))
    g = grad_out.astype(ms.float32)
    dv = ops.matmul(p.swapaxes(-1, -2), g)
    dp = ops.matmul(g, v.astype(ms.float32).swapaxes(-1, -2))
    delta = (g * out.astype(ms.float32)).sum(-1, keepdim=True)
    ds = p * (dp - delta)
    if capped is not None:
        ds = ds * (1 - capped * capped)   # d(c·tanh(s/c))/ds
    dq = ops.matmul(ds, k.astype(ms.float32)) * scale
    dk = ops.matmul(ds.swapaxes(-1, -2), q.astype(ms.float32)) * scale
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)
