"""The benchmark's MindSpore adapter (``HP_PLATFORM=mindspore``, PyNative); see ``cp_frameworks``.

Backward is functional on MindSpore: ``ms.vjp`` runs the forward and returns a function that maps
the output's cotangent (``grad_out``) to the inputs' gradients -- the same product as torch's
``out.backward(grad_out)``, with no extra loss term in the timed region.
"""
import os

import numpy as np

import mindspore as ms
from mindspore import mint

import hyper_parallel as hp
from benchmarks.cp_frameworks import FrameworkOps, UnsupportedConfig
from hyper_parallel.platform.mindspore import scaled_dot_product_attention


class Attention(ms.nn.Cell):
    """Core attention on BSHD tensors (hyper_parallel's SDPA: MindSpore has none on CPU); with a
    sliding window, ``hyper_parallel.attention``."""

    def __init__(self, causal, gqa, window=None):
        super().__init__()
        self.causal, self.gqa, self.window = causal, gqa, window

    def construct(self, q, k, v):
        q, k, v = (x.swapaxes(1, 2) for x in (q, k, v))
        if self.window is not None:
            return hp.attention(q, k, v, is_causal=True, window=self.window).swapaxes(1, 2)
        out = scaled_dot_product_attention(q, k, v, is_causal=self.causal, enable_gqa=self.gqa)
        return out.swapaxes(1, 2)


class MindSporeOps(FrameworkOps):
    name = "mindspore"

    def __init__(self, platform, dtype_name):
        self.platform = platform
        self.dtype_name = dtype_name
        self.dtype = getattr(ms, dtype_name)
        if platform.device_type == "cpu":
            # the CPU memory pool keeps freed blocks and has no statistics: RSS growth would read 0
            self.peak_memory_unsupported = (
                "MindSpore on CPU keeps freed tensors in its own memory pool and reports no "
                "allocator statistics (ms.runtime.max_memory_allocated() is 0), so a region's peak "
                "is not measurable")
            self.solo_timing_unsupported = (
                "MindSpore's CPU collectives busy-wait (stealing the cores rank 0 would time on) and "
                "give up after 30 s")

    def check_dtype(self):
        """Attention forward and backward on a tiny input: CPU lacks some kernels (bfloat16 matmul)."""
        x = self.tensor(np.ones((1, 2, 2, 4), np.float32))
        try:
            self.forward_backward(self.attention(True, False), [x, x, x], x)
            self.platform.synchronize()
        except (RuntimeError, TypeError, ValueError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise UnsupportedConfig(f"--dtype {self.dtype_name} does not run on MindSpore "
                                    f"{self.platform.device_type.upper()}: {first}") from None

    def set_threads(self, world):
        if self.platform.device_type == "cpu":  # MindSpore's default is 25 kernel threads per process
            ms.device_context.cpu.op_tuning.threads_num(max(1, (os.cpu_count() or 1) // world))

    def tensor(self, array):
        return ms.Tensor(np.ascontiguousarray(array)).astype(self.dtype)

    def to_numpy(self, tensor):
        if tensor.dtype not in (ms.float32, ms.float64):
            tensor = tensor.astype(ms.float32)  # numpy has no bfloat16
        return tensor.asnumpy()

    def block(self, tensor, dim, start, length):
        return mint.narrow(tensor, dim, start, length).contiguous()

    def forward(self, fn, inputs):
        with self.platform.no_grad():
            return fn(*inputs)

    def forward_backward(self, fn, inputs, grad_out):
        out, pullback = ms.vjp(fn, *inputs)
        grads = pullback(grad_out)
        return out, list(grads) if isinstance(grads, tuple) else [grads]

    def max_abs_diff(self, a, b):
        a, b = (self.to_numpy(t).astype(np.float64) for t in (a, b))
        return float(np.abs(a - b).max())

    def element_size(self):
        return ms.Tensor([0], self.dtype).itemsize

    def scalar(self, value):
        return ms.Tensor([float(value)], ms.float32)

    def attention(self, causal, gqa, window=None):
        return Attention(causal, gqa, window)

    def sdpa(self, q, k, v, causal, gqa, mask=None):
        q, k, v = (x.swapaxes(1, 2) for x in (q, k, v))
        if mask is not None:
            out = scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        else:
            out = scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
        return out.swapaxes(1, 2)

    def causal_mask(self, rows, keys, row_start):
        allowed = np.arange(keys)[None, :] <= (np.arange(rows) + row_start)[:, None]
        return ms.Tensor(allowed)

    def cat(self, tensors, dim):
        return mint.cat(list(tensors), dim)

    def chunk(self, tensor, parts, dim):
        return mint.chunk(tensor, parts, dim)
