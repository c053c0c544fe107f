"""Attention on one block of keys that also returns (and can restart from) the log-sum-exp: the
kernels ring attention is built from. Tensors are (batch, heads, seq, dim); ``causal`` is the
top-left aligned mask j <= i; ``mask`` (optional) is a boolean tensor broadcastable to (batch, heads,
q seq, k seq), True where attention is allowed. The log-sum-exp is float32 (float64 for float64
inputs), shaped (batch, heads, seq). A row whose mask is all False has an unspecified output and
log-sum-exp (the CPU kernel gives 0 for both): callers that mask rows away handle them.
``softcap`` c (optional, Gemma 2's logit soft-capping) replaces each scaled score s by c·tanh(s / c)
before the masks and the softmax; the fused kernels have no such step, so a soft-capped block runs
the plain tensor version (exact; its backward goes through d tanh = 1 - tanh²).

CPU uses the fused flash-attention-for-CPU kernels; elsewhere a plain tensor version (exact, not
memory-efficient) is the fallback.
"""
from typing import Any
import torch

_aten = torch.ops.aten


def _additive(mask, like):
    """The CPU flash kernels take a float mask in q's dtype, added to the scores."""
    if mask is None:
        return None
    return torch.zeros(mask.shape, dtype=like.dtype, device=like.device).masked_fill(~mask, float("-inf"))


def _cpu_flash(q):
    return q.device.type == "cpu" and q.dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def _pad_dim(t, size):
    """Zero columns on the head dim: they add nothing to q·k nor to p·v, so padding q/k or v to one
    head size is exact (MLA's v head dim differs from q/k's; the fused kernels take one size)."""
    return t if t.shape[-1] == size else torch.nn.functional.pad(t, (0, size - t.shape[-1]))


def _cut(t, size):
    return t if t.shape[-1] == size else t[..., :size].contiguous()


def block_forward(q: Any, k: Any, v: Any, causal: Any, scale: Any, mask: Any = None,
                  softcap: Any = None) -> Any:
    if softcap or not _cpu_flash(q):
        return _math_forward(q, k, v, causal, scale, mask, softcap)
    size, scale = max(q.shape[-1], v.shape[-1]), q.shape[-1] ** -0.5 if scale is None else scale
    out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(
        _pad_dim(q, size), _pad_dim(k, size), _pad_dim(v, size), 0.0, causal, attn_mask=_additive(mask, q),
        scale=scale)
    return _cut(out, v.shape[-1]), lse


def block_backward(grad_out: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, causal: Any, scale: Any,
                   mask: Any = None, softcap: Any = None) -> Any:
    if softcap or not _cpu_flash(q):
        return _math_backward(grad_out, q, k, v, out, lse, causal, scale, mask, softcap)
    size, scale = max(q.shape[-1], v.shape[-1]), q.shape[-1] ** -0.5 if scale is None else scale
    dq, dk, dv = _aten._scaled_dot_product_flash_attention_for_cpu_backward(
        _pad_dim(grad_out.contiguous(), size), _pad_dim(q, size), _pad_dim(k, size), _pad_dim(v, size),
        _pad_dim(out, size), lse, 0.0, causal, attn_mask=_additive(mask, q), scale=scale)
    return _cut(dq, q.shape[-1]), _cut(dk, k.shape[-1]), _cut(dv, v.shape[-1])


def _acc(t):
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _scores(q, k, causal, scale, mask=None, softcap=None):
    """(masked scores, scale, tanh of the capped scores or None)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = torch.matmul(_acc(q), _acc(k).transpose(-1, -2)) * scale
    capped = None
    if softcap:
        capped = torch.tanh(s / softcap)
        s = capped * softcap
    if causal:
        triangle = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(~triangle, float("-inf"))
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return s, scale, capped


def _math_forward(q, k, v, causal, scale, mask=None, softcap=None):
    s, _, _ = _scores(q, k, causal, scale, mask, softcap)
    lse = torch.logsumexp(s, dim=-1)
    out = torch.matmul(torch.exp(s - lse.unsqueeze(-1)), _acc(v))
    return out.to(q.dtype), lse


def _math_backward(grad_out, q, k, v, out, lse, causal, scale, mask=None, softcap=None):
    s, scale, capped = _scores(q, k, causal, scale, mask, softcap)
    p = torch.exp(s - lse.unsqueeze(-1))
    g = _acc(grad_out)
    dv = torch.matmul(p.transpose(-1, -2), g)
    dp = torch.matmul(g, _acc(v).transpose(-1, -2))
    delta = (g * _acc(out)).sum(-1, keepdim=True)
    ds = p * (dp - delta)
    if capped is not None:
        ds = ds * (1 - capped * capped)   # d(c·tanh(s/c))/ds; masked entries have p = 0 already
    dq = torch.matmul(ds, _acc(k)) * scale
    dk = torch.matmul(ds.transpose(-1, -2), _acc(q)) * scale
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
