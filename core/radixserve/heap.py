"""Giving the C heap's free pages back to the operating system."""

from __future__ import annotations

import ctypes


def release_free_heap() -> None:
    """Hand the pages glibc's heap holds free back to the OS (`malloc_trim(0)`). Why: glibc keeps
    memory freed by a one-off phase (parsing a tokenizer file, reading and repacking weights at load)
    resident in the heap; after model load the scheduler process held 16-27 MB of it (SmolLM2, fp32 /
    kept blocks), a tokenizer process ~14 MB. A no-op where the C library is not glibc."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
