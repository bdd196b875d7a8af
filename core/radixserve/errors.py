"""Errors the runtime raises to its callers (the Engine and the HTTP layer)."""

from __future__ import annotations

import os


class RequestError(Exception):
    """A request failed; `status` is the HTTP status the server should answer with
    (400: the request is invalid, e.g. too long; 503: the engine is dead or shutting down)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.status = status

    def __repr__(self) -> str:
        return f"RequestError({self.message!r}, status={self.status})"


class EngineDeadError(RequestError):
    """A runtime child process died; every in-flight and later request gets this error."""

    def __init__(self, message: str) -> None:
        super().__init__(message, status=503)


def traceback_worth_showing(e: BaseException) -> bool:
    """Whether a start-up failure gets its traceback: not for a bad value the user gave (a config key, a
    path, a shape the model cannot be split into: ConfigError is a ValueError, a missing file a
    FileNotFoundError), nor for a component the user must fix (a PluginError: e.g. an attention backend class
    refused before the weights load), which the entry points report as one line, unless RADIXSERVE_DEBUG=1
    asks for it."""
    from radixserve.plugins.registry import PluginError  # here: the registry is not needed to import this module

    user_errors = (ValueError, FileNotFoundError, PluginError)
    return not isinstance(e, user_errors) or bool(os.environ.get("RADIXSERVE_DEBUG"))
