"""Grammar compilation off the scheduler loop: a thread pool, and a cache of compiled grammars.

A constrained request waits in the queue until its grammar is compiled; the batch keeps running
meanwhile (the scheduler only polls futures). The backend itself (which reads the whole vocabulary)
is built in the pool on the first constrained request, so servers that never see one pay nothing."""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from radixserve.interfaces.grammar import GRAMMAR_KINDS, GrammarBackend, GrammarError
from radixserve.scheduler.stop_strings import StopStringMatcher
from radixserve.state import SamplingParams

logger = logging.getLogger(__name__)


def constraint_of(sp: SamplingParams) -> tuple[str, str] | None:
    """(kind, text) of the request's constraint, or None (SamplingParams.validate allows at most one)."""
    for kind in GRAMMAR_KINDS:
        text = getattr(sp, kind, None)
        if text is not None:
            return kind, text
    return None


class GrammarCompileError(Exception):
    """A request's constraint cannot be used; `message` is the client's error (it names the field),
    `status` its HTTP status: 400, or 500 when the backend broke its contract (a server bug)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.status = status


def grammar_timeout_refusal(kind: str, compile_future: Future, timeout_s: float) -> tuple[str, int]:
    """The error (message, HTTP status) of a request whose grammar was not ready within
    `stack.grammar_compile_timeout_s`: its own constraint compiling for at least half of that is the request's
    (400); otherwise it mostly waited for a thread (or the backend's build) that other work held (503: retry
    later; grammar audit 34: a 1 s compile after 7 s in the queue was told to simplify itself)."""
    started = getattr(compile_future, "compile_started", None)
    compiling = time.monotonic() - started[0] if started else 0.0
    if compiling >= timeout_s / 2:
        return (f"{kind}: the constraint did not compile within {timeout_s:g} s (stack.grammar_compile_timeout_s; it "
                f"was compiling for {compiling:.1f} s of them); long bounded repetitions ({{1,100}}, maxLength) and "
                "nested ones compile slowly: simplify it", 400)
    return (f"{kind}: the constraint was not compiled within {timeout_s:g} s: it waited {timeout_s - compiling:.1f} s "
            "for a compile thread or the grammar backend, busy with other constraints (stack.grammar_compile_threads, "
            "stack.grammar_compile_timeout_s); retry later", 503)


class DeferredGrammar:
    """A compiled grammar whose matcher starts once the output's text contains `after` (the end of
    a reasoning section, `</think>`): the scheduler pushes each output token until `reached` says
    the marker is complete, then constrains the tokens after it. The marker is found in the decoded
    text (special tokens kept), so it works whether the model writes it as one token or several;
    text that shares the marker's last token is not checked by the grammar."""

    def __init__(self, compiled: Any, after: str, tokenizer: Any, context_ids: list[int]) -> None:
        self.compiled = compiled
        self._watch = StopStringMatcher(tokenizer, [after], context_ids, skip_special_tokens=False)

    def reached(self, token: int) -> bool:
        """Push the next output token; True once the output contains the marker."""
        return self._watch.push(token) is not None


class GrammarService:
    """Compiles constraints in `threads` worker threads and keeps the last `cache_size` compiled
    grammars, keyed by (backend, kind, text, tokenizer): identical constraints (n > 1 choices, a
    tool's schema, a popular response format) compile once, even when requested concurrently."""

    def __init__(
        self,
        name: str,
        make_backend: Callable[[], GrammarBackend],
        tokenizer_key: str = "",
        threads: int = 2,
        cache_size: int = 256,
    ) -> None:
        self.name = name
        self._make_backend = make_backend
        self._tokenizer_key = tokenizer_key
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="grammar")
        self._backend_future: Future | None = None
        self._cache: OrderedDict[tuple[str, str, str, str], Future] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()

    # ---- backend ------------------------------------------------------------------------------
    def _backend_started(self) -> Future:
        with self._lock:
            if self._backend_future is None:
                self._backend_future = self._pool.submit(self._build_backend)
            return self._backend_future

    def _build_backend(self) -> GrammarBackend:
        try:
            return self._make_backend()
        except Exception:  # built once: the operator sees why every constrained request is refused
            logger.exception("the grammar backend %r could not be built; constrained requests get a 400", self.name)
            raise

    def backend(self, kind: str | None = None) -> GrammarBackend:
        """The backend (builds it on first use; raises GrammarCompileError, naming `kind`'s field
        when given, when it cannot be built)."""
        try:
            return self._backend_started().result()
        except GrammarCompileError:
            raise
        except Exception as e:
            field = f"{kind}: " if kind else ""
            raise GrammarCompileError(f"{field}the grammar backend {self.name!r} is unavailable: {e}") from None

    @property
    def ready_backend(self) -> GrammarBackend | None:
        """The backend once built (never waits)."""
        f = self._backend_future
        return f.result() if f is not None and f.done() and f.exception() is None else None

    # ---- compiling ----------------------------------------------------------------------------
    def compile(self, kind: str, text: str) -> Future:
        """A future of the compiled grammar; it raises GrammarCompileError naming the field."""
        key = (self.name, kind, text, self._tokenizer_key)
        # the backend's build is queued first: a compile waits for it in the same FIFO pool, so with one
        # thread a build queued behind the first compile never ran (every constrained request hung)
        self._backend_started()
        with self._lock:
            fut = self._cache.get(key)
            if fut is not None:
                self._cache.move_to_end(key)
                return fut
            started: list[float] = []  # when its compile began (after waiting for a thread and the backend)
            fut = self._pool.submit(self._compile, kind, text, started)
            fut.compile_started = started  # type: ignore[attr-defined]  # read by grammar_timeout_refusal
            self._cache[key] = fut
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return fut

    def _compile(self, kind: str, text: str, started: list[float]) -> Any:
        backend = self.backend(kind)
        if kind not in backend.supported_kinds:
            raise GrammarCompileError(
                f"{kind}: the grammar backend {self.name!r} does not support {kind} constraints "
                f"(it supports {', '.join(backend.supported_kinds)})"
            )
        started.append(time.monotonic())
        try:
            return backend.compile(kind, text)
        except GrammarError as e:
            raise GrammarCompileError(f"{kind}: {_invalid(kind)}: {e}") from None
        except Exception as e:  # a backend breaking its contract (GrammarError only): a server error, not the input's
            logger.exception("grammar backend %r failed compiling a %s constraint", self.name, kind)
            raise GrammarCompileError(
                f"{kind}: the grammar backend {self.name!r} failed while compiling this constraint: {e!r} (a server "
                "error, logged; not a verdict on the constraint)", 500
            ) from None

    def cached(self) -> int:
        return len(self._cache)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _invalid(kind: str) -> str:
    return {"json_schema": "invalid JSON schema", "regex": "invalid regex", "ebnf": "invalid EBNF grammar"}.get(
        kind, "invalid constraint"
    )


def tokenizer_fingerprint(model_path: str, tokenizer_path: str | None) -> str:
    """A short key naming the tokenizer in the grammar cache."""
    return hashlib.sha1(f"{model_path}|{tokenizer_path}".encode()).hexdigest()[:12]
