"""The one log-line format of every RadixServe process (the server, the router, a replica and each runtime
child): `2026-12-06 23:04:58,123 [replica 0] scheduler INFO radixserve.scheduler: message`, so lines of
several processes interleaved on one terminal or in one file sort by time and say who wrote them.

A process calls `configure_logging` once, before anything logs; a later call is a no-op (basicConfig's
rule), so an entry point that configures again does not change the format its parent chose."""

from __future__ import annotations

import logging


def log_format(label: str) -> str:
    """The format string for a process labelled `label` (e.g. "scheduler", "[replica 1] server")."""
    return f"%(asctime)s {label} %(levelname)s %(name)s: %(message)s"


def configure_logging(level: int | str, label: str) -> None:
    """The root logger at `level` (a logging level or a name such as "warning") in the common format."""
    if isinstance(level, str):
        level = getattr(logging, level.upper(), logging.INFO)
    logging.basicConfig(level=level, format=log_format(label))
