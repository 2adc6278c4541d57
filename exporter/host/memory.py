"""Giving memory back to the system once a leak storm's inventory is gone."""

from __future__ import annotations

import ctypes
import ctypes.util


def release() -> None:
    """glibc keeps freed heap pages (its arenas' tops and free chunks) until asked:
    malloc_trim(0) returns them. A no-op where there is none (musl)."""
    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
