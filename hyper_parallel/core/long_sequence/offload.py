"""``offload_activations()``: the tensors autograd saves for backward kept in host memory.

Long sequences make the saved activations the largest thing on the device (every block keeps its
inputs, norms, projections and attention outputs until backward reaches it). Inside the context
each tensor autograd saves is copied to host memory as it is saved (pinned where the device
allows, the copy issued without waiting), and the device copy is freed once forward drops it;
backward copies each one back when its node needs it (again without waiting; the copy is ordered
before the kernel that reads it). Parameters and tensor subclasses (DTensors) stay where they are.
The cost is the transfer time: host-device bandwidth against the compute that hides it.
"""
from typing import Any, Iterator
import contextlib

from hyper_parallel.platform import get_platform

__all__ = ["offload_activations", "OffloadStats"]


class OffloadStats:
    """What one ``offload_activations()`` context moved: ``offloaded`` tensors / ``offloaded_bytes``,
    ``kept`` (parameters, subclasses), ``restored`` (copied back in backward so far)."""

    def __init__(self) -> None:
        self.offloaded = self.offloaded_bytes = self.kept = self.restored = 0

    def __repr__(self):
        return (f"OffloadStats(offloaded={self.offloaded}, offloaded_bytes={self.offloaded_bytes}, "
                f"kept={self.kept}, restored={self.restored})")


def _nbytes(tensor):
    # the platform's count: MindSpore tensors have no element_size() (they were counted as 0 bytes)
    return get_platform().tensor_nbytes(tensor)


@contextlib.contextmanager
def offload_activations() -> Iterator[Any]:
    """Inside, activations saved for backward live in host memory; yields an ``OffloadStats``.
    Backward may run inside or after the context (the hooks that restore are kept per tensor)."""
    platform = get_platform()
    stats = OffloadStats()

    def pack(tensor: Any) -> Any:
        if isinstance(tensor, platform.Parameter):
            stats.kept += 1
            return (False, tensor)
        host = platform.host_copy(tensor)
        if host is None:
            stats.kept += 1
            return (False, tensor)
        stats.offloaded += 1
        stats.offloaded_bytes += _nbytes(tensor)
        return (True, (host, tensor.device))

    def unpack(packed: Any) -> Any:
        moved, value = packed
        if not moved:
            return value
        stats.restored += 1
        host, device = value
        return platform.device_copy(host, device)

    with platform.saved_tensors_hooks(pack, unpack):
        yield stats
