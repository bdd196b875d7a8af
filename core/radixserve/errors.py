"""Errors the runtime raises to its callers (the Engine and the HTTP layer)."""

from __future__ import annotations


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


def is_users_mistake(e: BaseException) -> bool:
    """A bad value the user gave (a config key, a path, a shape the model cannot be split into): the
    entry points report it as one line, with no traceback (RADIXSERVE_DEBUG=1 shows one). ConfigError is a
    ValueError; a missing file is a FileNotFoundError."""
    return isinstance(e, (ValueError, FileNotFoundError))
