"""Prometheus metrics of the server (prometheus-client), exposed as text on /metrics.

Each `ServerMetrics` owns its own CollectorRegistry, so several apps (tests) never collide.
Request-level series are updated by the handlers; scheduler series are refreshed from
`tm.get_stats()` at scrape time, one gauge per numeric stat."""

from __future__ import annotations

import json
import logging
import re
import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

PREFIX = "radixserve"
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_TOKEN_BUCKETS = (1, 8, 32, 128, 512, 1024, 2048, 4096, 8192, 16384, 32768)

CONTENT_TYPE = CONTENT_TYPE_LATEST
# route label of each generation path (the label the handlers use; /v1/responses runs on the chat route's handler)
GENERATION_ROUTES = {"/v1/chat/completions": "chat", "/v1/completions": "completions", "/generate": "generate",
                     "/v1/responses": "chat"}

logger = logging.getLogger("radixserve.server.openai_serving")  # beside the handlers' request lines


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        r = self.registry
        labels = ["model"]
        self.requests = Counter(
            f"{PREFIX}_requests", "Finished HTTP generation requests", ["model", "route", "status"], registry=r
        )
        self.prompt_tokens = Counter(f"{PREFIX}_prompt_tokens", "Prompt tokens processed", labels, registry=r)
        self.generation_tokens = Counter(f"{PREFIX}_generation_tokens", "Tokens generated", labels, registry=r)
        self.cached_tokens = Counter(
            f"{PREFIX}_cached_tokens", "Prompt tokens served from the prefix cache", labels, registry=r
        )
        self.in_flight = Gauge(f"{PREFIX}_requests_in_flight", "Generation requests being served", labels, registry=r)
        self.ttft = Histogram(
            f"{PREFIX}_time_to_first_token_seconds",
            "Time to first token (streaming)",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            f"{PREFIX}_e2e_request_latency_seconds", "Request latency", labels, buckets=_LATENCY_BUCKETS, registry=r
        )
        self.prompt_len = Histogram(
            f"{PREFIX}_request_prompt_tokens", "Prompt length per request", labels, buckets=_TOKEN_BUCKETS, registry=r
        )
        self.output_len = Histogram(
            f"{PREFIX}_request_generation_tokens",
            "Generated tokens per request",
            labels,
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self._stat_gauges: dict[str, Gauge] = {}
        # every model-labelled series exists from the start at 0 (as vLLM's): an idle replica's rate() and
        # in-flight alerts see zeros, not absent series (operator audit 30)
        for metric in (self.prompt_tokens, self.generation_tokens, self.cached_tokens, self.in_flight, self.ttft,
                       self.e2e, self.prompt_len, self.output_len):
            metric.labels(model=model_name)
        for route in GENERATION_ROUTES.values():  # the answered requests' series too (newcomer audit 34)
            self.requests.labels(model_name, route, "200")

    def observe_request(
        self,
        route: str,
        status: int,
        prompt_tokens: int,
        completion_tokens: int,
        cached_tokens: int,
        latency_s: float,
        ttft_s: float | None,
    ) -> None:
        m = self.model_name
        self.requests.labels(m, route, str(status)).inc()
        self.prompt_tokens.labels(m).inc(prompt_tokens)
        self.generation_tokens.labels(m).inc(completion_tokens)
        self.cached_tokens.labels(m).inc(cached_tokens)
        self.prompt_len.labels(m).observe(prompt_tokens)
        self.output_len.labels(m).observe(completion_tokens)
        self.e2e.labels(m).observe(latency_s)
        if ttft_s is not None:
            self.ttft.labels(m).observe(ttft_s)

    def observe_failure(self, route: str, status: int) -> None:
        self.requests.labels(self.model_name, route, str(status)).inc()

    def update_stats(self, stats: dict[str, Any]) -> None:
        """Mirror the scheduler's numeric stats as gauges named radixserve_scheduler_<key>."""
        for key, value in stats.items():
            # "time" is when the stats were read (a Unix time): Prometheus stamps its scrapes itself
            if key == "time" or isinstance(value, bool) or not isinstance(value, int | float):
                continue
            gauge = self._stat_gauges.get(key)
            if gauge is None:
                name = f"{PREFIX}_scheduler_" + re.sub(r"[^a-zA-Z0-9_]", "_", key)
                gauge = Gauge(name, f"Scheduler stat {key}", ["model"], registry=self.registry)
                self._stat_gauges[key] = gauge
            gauge.labels(self.model_name).set(value)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class ErrorStatusMiddleware:
    """Calls `failed(route, status, latency_s, scope, reason)` for every generation request (the routes of
    GENERATION_ROUTES) answered with an HTTP error status, whoever answered it: added outermost, it sees the
    API-key and size guards' answers too. `reason` is the answer's OpenAI-shape `error.message` ("" when the body
    has none). Subclasses say what a failure is counted and logged as."""

    MAX_BODY = 16384  # bytes of an error answer kept to find its message (error bodies are small)

    def __init__(self, app) -> None:
        self.app = app

    def failed(self, route: str, status: int, latency_s: float, scope: dict, reason: str) -> None:
        raise NotImplementedError

    async def __call__(self, scope, receive, send) -> None:
        route = GENERATION_ROUTES.get(scope.get("path", "")) if scope["type"] == "http" else None
        if route is None:
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status: int | None = None
        body = bytearray()

        async def observe(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and status is not None and status >= 400:
                body.extend(message.get("body", b"")[: self.MAX_BODY - len(body)])
            await send(message)

        try:
            await self.app(scope, receive, observe)
        finally:
            if status is not None and status >= 400:
                self.failed(route, status, time.perf_counter() - started, scope, error_message(bytes(body)))


def error_message(body: bytes) -> str:
    """The `error.message` of an OpenAI-shape error body, or "" (another body, or none)."""
    try:
        error = json.loads(body).get("error")
    except (ValueError, AttributeError):
        return ""
    message = error.get("message") if isinstance(error, dict) else None
    return message if isinstance(message, str) else ""


def client_of(scope: dict) -> str:
    """host:port of the request's peer, as a log names it ("-" where the server was not told)."""
    client = scope.get("client")
    return f"{client[0]}:{client[1]}" if client else "-"


class FailedRequestMiddleware(ErrorStatusMiddleware):
    """Counts (requests_total{status}) and logs every generation request answered with an HTTP
    error status: refused before generating (validation, API key, body size, budget) or failed
    while collecting a non-streamed result, or the client gone (499). Why here: those never reach
    the handlers' own accounting, which counts successes and streams (HTTP 200, an error event
    inside) where they end."""

    def __init__(self, app, metrics: ServerMetrics, log_requests: bool) -> None:
        super().__init__(app)
        self.metrics = metrics
        self.log_requests = log_requests

    def failed(self, route: str, status: int, latency_s: float, scope: dict, reason: str) -> None:
        self.metrics.observe_failure(route, status)
        if self.log_requests:
            logger.info("request - %s status=%d latency=%.3fs client=%s: %s", route, status, latency_s, client_of(scope),
                        reason or "(no error message)")
