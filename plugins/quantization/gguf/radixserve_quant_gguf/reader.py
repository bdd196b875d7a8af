"""Open GGUF files once per process (parsing the metadata of a 49k-token vocabulary takes seconds)."""

from __future__ import annotations

import functools
import os
from typing import Any


@functools.lru_cache(maxsize=2)
def _open(path: str, mtime: float):
    import gguf

    return gguf.GGUFReader(path)


def open_gguf(path: str):
    """A cached `gguf.GGUFReader` for `path` (re-read when the file changes)."""
    path = os.path.abspath(path)
    return _open(path, os.path.getmtime(path))


def field(reader, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()
