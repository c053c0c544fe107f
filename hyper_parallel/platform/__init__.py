"""The only layer that touches a deep-learning framework.

``get_platform()`` returns the process-wide :class:`Platform` chosen by ``HP_PLATFORM``
(alias ``HYPER_PARALLEL_PLATFORM``): ``torch``, ``npu`` or ``mindspore``.
"""
from hyper_parallel.platform.base import Platform, AsyncHandle
from hyper_parallel.platform.selection import get_platform, on_reset, reset_platform, VALID_PLATFORMS

__all__ = ["Platform", "AsyncHandle", "get_platform", "on_reset", "reset_platform", "VALID_PLATFORMS"]
