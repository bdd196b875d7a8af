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

    @property
    def total(self) -> int:
        """Failures of every hook so far (stats `plugin_failures`: the log shows only the first)."""
        return sum(self.counts.values())

    def exception(self, what: str) -> None:
        n = self.counts[what] = self.counts.get(what, 0) + 1
        if n == 1:
            self.logger.exception("%s (traceback shown once; every failure is counted in /server_info "
                                  "plugin_failures, and every %dth logged)", what, self.every)
        elif n % self.every == 0:
            self.logger.warning("%s: %d failures so far, the last: %r", what, n, sys.exc_info()[1])
