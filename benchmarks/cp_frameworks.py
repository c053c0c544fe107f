"""The tensor operations the benchmark needs, one adapter per framework.

The benchmark's measuring code (``cp_attention``) and the hand-written modes (``cp_modes``) only
talk to a :class:`FrameworkOps`; ``benchmarks.cp_torch`` (torch, also for ``HP_PLATFORM=npu``) and
``benchmarks.cp_mindspore`` implement it. Each adapter module imports its framework at the top, so
this selector imports the one the platform needs and nothing else: a MindSpore environment without
torch never reaches ``import torch``.
"""


class UnsupportedConfig(Exception):
    """The requested configuration cannot run on this framework/device (e.g. a dtype with no kernels)."""


class FrameworkOps:
    """What an adapter provides. Tensors are BSHD (batch, seq, heads, dim) unless noted."""

    name = "?"
    # None if the platform's track_peak_memory() measures a region here, else why not
    peak_memory_unsupported = None
    # None if ranks can idle in a barrier while rank 0 times the reference alone, else why not
    solo_timing_unsupported = None

    def check_dtype(self):
        """Raise UnsupportedConfig if attention forward+backward cannot run in the dtype."""

    def set_threads(self, world):
        """Share the host's cores between the ``world`` local ranks."""

    def tensor(self, array):
        """A numpy float32 array as a framework tensor in the benchmark dtype, on the device."""
        raise NotImplementedError

    def to_numpy(self, tensor):
        raise NotImplementedError

    def block(self, tensor, dim, start, length):
        """A contiguous copy of ``tensor[start:start + length]`` along ``dim``."""
        raise NotImplementedError

    def forward(self, fn, inputs):
        """``fn(*inputs)`` without recording anything for backward."""
        raise NotImplementedError

    def forward_backward(self, fn, inputs, grad_out):
        """(output, [gradient of each input]) for the backward seeded with ``grad_out``."""
        raise NotImplementedError

    def max_abs_diff(self, a, b):
        """max |a - b| as a Python float, computed in float32 or wider."""
        raise NotImplementedError

    def element_size(self):
        """Bytes per element of the benchmark dtype."""
        raise NotImplementedError

    def scalar(self, value):
        """A one-element float32 tensor (for all_reduce / all_gather of per-rank numbers)."""
        raise NotImplementedError

    def attention(self, causal, gqa, window=None):
        """A core-attention module/Cell ``(q, k, v) -> out`` that ContextParallel can be applied to;
        ``window``: a causal sliding window of that many keys (``hyper_parallel.attention``)."""
        raise NotImplementedError

    def sdpa(self, q, k, v, causal, gqa, mask=None):
        """Plain attention; a boolean ``mask`` (rows, keys) replaces ``causal`` when given."""
        raise NotImplementedError

    def causal_mask(self, rows, keys, row_start):
        """Boolean (rows, keys): query row ``row_start + i`` may see key j when j <= row_start + i."""
        raise NotImplementedError

    def cat(self, tensors, dim):
        raise NotImplementedError

    def chunk(self, tensor, parts, dim):
        raise NotImplementedError


def framework_ops(platform, dtype_name):
    """The adapter for ``platform`` (hyper_parallel's), working in ``dtype_name``."""
    if platform.name == "mindspore":
        from benchmarks.cp_mindspore import MindSporeOps
        return MindSporeOps(platform, dtype_name)
    from benchmarks.cp_torch import TorchOps  # torch and npu
    return TorchOps(platform, dtype_name)
