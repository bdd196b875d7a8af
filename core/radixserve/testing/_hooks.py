"""How the conformance kits call a plugin's hooks: its own error becomes an AssertionError naming the case."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def call_hook(hook: Callable[..., Any], *args: Any, where: str) -> Any:
    """`hook(*args)`; an exception it raises is re-raised as an AssertionError saying `where` (the case:
    seed, step, the call) raised it (the scheduler survives a raising hook; a kit must not pass it)."""
    try:
        return hook(*args)
    except Exception as e:
        raise AssertionError(f"{where} raised {type(e).__name__}: {e}") from e
