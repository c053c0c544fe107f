"""The torch side of the test-case adapter (see tests/frameworks/__init__.py)."""
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


class TorchOps:
    """Functional ops under neutral names, spelled the way torch users write them."""
    exp, tanh, relu, where = staticmethod(torch.exp), staticmethod(torch.tanh), staticmethod(torch.relu), \
        staticmethod(torch.where)
    matmul, bmm, linear = staticmethod(torch.matmul), staticmethod(torch.bmm), staticmethod(F.linear)

    @staticmethod
    def softmax(a, dim):
        return F.softmax(a, dim=dim)

    @staticmethod
    def log_softmax(a, dim):
        return F.log_softmax(a, dim=dim)

    @staticmethod
    def cat(tensors, dim):
        return torch.cat(tensors, dim)

    @staticmethod
    def dropout(a, p):
        return F.dropout(a, p=p)

    @staticmethod
    def half_roundtrip(a):
        return a.to(torch.float16).to(torch.float32)

    @staticmethod
    def sdpa(q, k, v, mask=None, causal=False):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)

    @staticmethod
    def cumsum(a, dim):
        return torch.cumsum(a, dim)

    @staticmethod
    def embedding(ids, table):
        return F.embedding(ids, table)

    @staticmethod
    def cumprod(a, dim):
        return torch.cumprod(a, dim)

    @staticmethod
    def trace(a):
        return torch.trace(a)


class TorchAdapter:
    """The interface every adapter implements; values cross it as numpy arrays."""
    name = "torch"
    ops = TorchOps

    # ------------------------------------------------------------------ tensors
    @staticmethod
    def tensor(array):
        return torch.from_numpy(np.array(array, order="C"))

    @staticmethod
    def numpy(x):
        return x.detach().cpu().numpy()

    @staticmethod
    def is_plain_tensor(x):
        return type(x) is torch.Tensor

    @staticmethod
    def noncontiguous(array):
        """A view with ``array``'s values that is not contiguous (a transposed copy)."""
        if array.ndim < 2:
            return torch.from_numpy(np.array(array))
        view = torch.from_numpy(np.ascontiguousarray(np.swapaxes(array, 0, 1))).transpose(0, 1)
        assert not view.is_contiguous()
        return view

    # ------------------------------------------------------------------ autograd
    @staticmethod
    def grad(fn, *inputs):
        leaves = [x.detach().clone().requires_grad_(True) for x in inputs]
        grads = torch.autograd.grad(fn(*leaves), leaves, allow_unused=True)
        return tuple(torch.zeros_like(x) if g is None else g for x, g in zip(leaves, grads))

    # ------------------------------------------------------------------ modules
    @staticmethod
    def attention(kind="sdpa", layout="bshd"):
        """Core attention ``forward(q, k, v, mask=None, causal=False)``: ``sdpa`` calls torch's SDPA;
        ``matmul`` is q @ kᵀ / softmax / @ v with the causal mask built from the global lengths.
        Fewer k/v heads than query heads is GQA (enable_gqa / repeated k, v)."""
        class Attention(nn.Module):
            def forward(self, q, k, v, mask=None, causal=False):
                if layout == "bshd":
                    q, k, v = (x.transpose(1, 2) for x in (q, k, v))
                gqa = q.shape[-3] != k.shape[-3]
                if kind == "sdpa":
                    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=gqa)
                else:
                    if gqa:
                        rep = q.shape[-3] // k.shape[-3]
                        k, v = k.repeat_interleave(rep, dim=-3), v.repeat_interleave(rep, dim=-3)
                    scores = q @ k.transpose(-2, -1) * (q.shape[-1] ** -0.5)
                    if causal:
                        sq, sk = q.shape[-2], k.shape[-2]
                        allowed = torch.ones(sq, sk, dtype=torch.bool).tril(sk - sq)
                        scores = scores.masked_fill(~allowed, float("-inf"))
                    if mask is not None:
                        scores = scores.masked_fill(~mask, float("-inf"))
                    o = scores.softmax(-1) @ v
                return o.transpose(1, 2) if layout == "bshd" else o
        return Attention()

    @staticmethod
    def mlp(kind, dim, hidden):
        """Linear(dim, hidden) -> relu -> Linear(hidden, dim) as ``w1``, ``w2``; ``kind``: "linear"."""
        class MLP(nn.Module):
            def __init__(self):
                super().__init__()
                self.w1, self.w2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

            def forward(self, x):
                return self.w2(torch.relu(self.w1(x)))
        return MLP()

    @staticmethod
    def projections(dim, out, names=("wq", "wk", "wv")):
        """Linear layers ``names`` (dim -> out) applied to one input: ``forward(x) -> tuple``."""
        class Projections(nn.Module):
            def __init__(self):
                super().__init__()
                for name in names:
                    setattr(self, name, nn.Linear(dim, out))

            def forward(self, x):
                return tuple(getattr(self, name)(x) for name in names)
        return Projections()

    @staticmethod
    def parameter_shapes(module):
        return {name: tuple(p.shape) for name, p in module.named_parameters()}

    @staticmethod
    def set_parameters(module, arrays):
        with torch.no_grad():
            for name, p in module.named_parameters():
                p.copy_(torch.from_numpy(arrays[name]))

    @staticmethod
    def grads_then_sgd(module, loss_fn, x, lr, input_grad=True):
        """The gradient of ``loss_fn(x)`` for ``x`` (None without ``input_grad``, e.g. for token
        ids) and for every parameter (this rank's local value, by name), then one SGD step on the
        parameters."""
        x = x.detach().clone().requires_grad_(True) if input_grad else x
        module.zero_grad()
        loss_fn(x).backward()
        grads = {name: _local(p.grad).numpy() for name, p in module.named_parameters()}
        torch.optim.SGD(module.parameters(), lr=lr).step()
        return (x.grad.numpy() if input_grad else None), grads

    @staticmethod
    def embedding_module(vocab, dim):
        return nn.Embedding(vocab, dim)

    # ------------------------------------------------------------------ framework-specific checks
    @staticmethod
    def extra_op_cases():
        """(name, fn, shapes, placement choices) of torch-only spellings."""
        return [("Tensor.softmax/F.gelu", lambda a: a.softmax(-1) + F.gelu(a), [(4, 6)], [["S0", "S1"]])]

    @staticmethod
    def unsupported_dtensor_operations(dt):
        """Operations on a DTensor that must raise (torch DTensors support in-place ops)."""
        return []


def _local(x):
    return x.to_local() if hasattr(x, "placements") else x
