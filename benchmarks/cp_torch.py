"""The benchmark's torch adapter (``HP_PLATFORM=torch`` and ``npu``); see ``cp_frameworks``."""
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

import hyper_parallel as hp
from benchmarks.cp_frameworks import FrameworkOps


class Attention(nn.Module):
    """Core attention on BSHD tensors; with a sliding window, ``hyper_parallel.attention`` (sdpa
    has no window argument)."""

    def __init__(self, causal, gqa, window=None):
        super().__init__()
        self.causal, self.gqa, self.window = causal, gqa, window

    def forward(self, q, k, v):
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if self.window is not None:
            return hp.attention(q, k, v, is_causal=True, window=self.window).transpose(1, 2)
        extra = {"enable_gqa": True} if self.gqa else {}
        return F.scaled_dot_product_attention(q, k, v, is_causal=self.causal, **extra).transpose(1, 2)


class TorchOps(FrameworkOps):
    name = "torch"

    def __init__(self, platform, dtype_name):
        self.platform = platform
        self.dtype = getattr(torch, dtype_name)
        self.device = platform.device()

    def set_threads(self, world):
        if self.platform.device_type == "cpu":
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))

    def tensor(self, array):
        return torch.from_numpy(array).to(device=self.device, dtype=self.dtype)

    def to_numpy(self, tensor):
        return tensor.detach().float().cpu().numpy()

    def block(self, tensor, dim, start, length):
        return tensor.narrow(dim, start, length).contiguous()

    def forward(self, fn, inputs):
        with torch.no_grad():
            return fn(*inputs)

    def forward_backward(self, fn, inputs, grad_out):
        leaves = [t.detach().requires_grad_() for t in inputs]
        out = fn(*leaves)
        out.backward(grad_out)
        return out.detach(), [t.grad for t in leaves]

    def max_abs_diff(self, a, b):
        wide = torch.promote_types(a.dtype, torch.float32)  # float64 keeps its precision
        return (a.detach().to(wide) - b.detach().to(wide)).abs().max().item()

    def element_size(self):
        return torch.empty((), dtype=self.dtype).element_size()

    def scalar(self, value):
        return torch.tensor([float(value)], device=self.device)

    def attention(self, causal, gqa, window=None):
        return Attention(causal, gqa, window)

    def sdpa(self, q, k, v, causal, gqa, mask=None):
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        extra = {"enable_gqa": True} if gqa else {}
        if mask is not None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **extra).transpose(1, 2)
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, **extra).transpose(1, 2)

    def causal_mask(self, rows, keys, row_start):
        key_pos = torch.arange(keys, device=self.device).unsqueeze(0)
        return key_pos <= (torch.arange(rows, device=self.device) + row_start).unsqueeze(1)

    def cat(self, tensors, dim):
        return torch.cat(tensors, dim)

    def chunk(self, tensor, parts, dim):
        return tensor.chunk(parts, dim)
