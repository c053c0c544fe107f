"""Peak memory of a region measured from outside: the process's resident-set high-water mark.

Linux resets a process's VmHWM to its current RSS when "5" is written to /proc/self/clear_refs;
the peak of a region is then VmHWM after it minus VmRSS before it, so every byte the process
touched counts, kernel-internal buffers and collective buffers included. Freed blocks only leave
RSS when malloc returns them to the system: the launcher pins ``MALLOC_MMAP_THRESHOLD_`` (blocks
above it are mmapped and unmapped on free) before it starts the ranks.
"""
import gc
import os

MMAP_THRESHOLD = "65536"


def _status_kib(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1])
    return None


def available():
    """True where the high-water mark can be reset (Linux with a writable clear_refs)."""
    return os.access("/proc/self/clear_refs", os.W_OK) and _status_kib("VmHWM:") is not None


def rss_peak_bytes(fn):
    """Bytes the process's RSS rose above its level before ``fn`` at the peak of ``fn()``."""
    gc.collect()
    before = _status_kib("VmRSS:")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    fn()
    return max(0, _status_kib("VmHWM:") - before) * 1024
