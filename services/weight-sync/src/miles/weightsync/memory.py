"""Process memory settings for moving large tensors.

Every streamed chunk is a fresh ~1 MiB buffer; with glibc's defaults each one is mmap'ed, page-faulted in and
unmapped again, which cost more CPU than the copies themselves and halved stream throughput. Raising the mmap
and trim thresholds keeps such buffers on the reusable heap. Called once by the daemon's main() (and by the
benchmark's receiving process); a no-op where glibc's mallopt is not available.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def tune_malloc_for_streaming(mmap_threshold_bytes: int = 64 << 20, trim_threshold_bytes: int = 512 << 20) -> bool:
    """Raise glibc's mmap/trim thresholds; returns whether they were applied."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(name)
        applied = bool(libc.mallopt(_M_MMAP_THRESHOLD, mmap_threshold_bytes))
        if not applied:  # older glibc caps the threshold at 32 MiB
            applied = bool(libc.mallopt(_M_MMAP_THRESHOLD, 32 << 20))
        return applied and bool(libc.mallopt(_M_TRIM_THRESHOLD, trim_threshold_bytes))
    return False
