"""Giving memory back to the system after a large buffer is freed.

CPython frees a large buffer to glibc's malloc, which keeps what it got in the heaps of the
threads that asked (an exec's output grows on one of the blocking pool's threads, in steps):
freed, yet still the process's, until malloc trims. ``malloc_trim(0)`` returns the free pages
of every heap. Measured on a 128 MiB blocking exec (64 MiB kept): see docs/limits.md.
"""

from __future__ import annotations

import ctypes
import ctypes.util

# Worth a trim: less is left to malloc's own trimming.
GIVE_BACK_AFTER = 8 * 1024 * 1024

_libc: ctypes.CDLL | None = None


def give_memory_back() -> None:
    """Return freed heap memory to the system (glibc; elsewhere, nothing)."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
    trim = getattr(_libc, "malloc_trim", None)
    if trim is not None:
        trim(0)
