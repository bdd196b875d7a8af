"""Logging of a plugin hook that fails on every step without flooding the log."""

from __future__ import annotations

import logging
import sys


class RepeatedFailureLog:
    """`exception(what)` inside an `except` block: the first failure of `what` is logged with its
    traceback, later ones as one warning line every `every` failures with the count and the last
    error. Why: a drafter that raises in `propose` fails on every decode step; its traceback each
    step buried everything else in the log (while serving went on correctly without drafts)."""

    def __init__(self, logger: logging.Logger, every: int = 100) -> None:
        self.logger = logger
        self.every = every
        self.counts: dict[str, int] = {}

    def exception(self, what: str) -> None:
        n = self.counts[what] = self.counts.get(what, 0) + 1
        if n == 1:
            self.logger.exception("%s (traceback shown once; later failures are counted)", what)
        elif n % self.every == 0:
            self.logger.warning("%s: %d failures so far, the last: %r", what, n, sys.exc_info()[1])
