"""The router's public HTTP app: the same routes as a single server, served by the replicas.

Generation routes are routed by the policy and relayed (proxy.py); /health, /health_generate,
/metrics, /server_info, /flush_cache and /abort_request ask every live replica; any other route
(model list, plugin routes) is answered by the first live replica. /v1/responses is routed by the
policy too, except that a request continuing a stored response (`previous_response_id`), and GET and
DELETE of one, go to the replica that stored it (response_affinity.py)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from radixserve.config import Config
from radixserve.server.auth import GuardMiddleware
from radixserve.server.errors import APIError, error_response, install_error_handlers
from radixserve.server.metrics import CONTENT_TYPE, ErrorStatusMiddleware, client_of
from radixserve.server.router.core import Router
from radixserve.server.router.metrics import RouterMetrics, aggregate_replica_metrics, aggregate_stats
from radixserve.server.router.proxy import FORWARDED, forward, forward_to, forward_to_one
from radixserve.server.router.replicas import Replica
from radixserve.server.router.response_affinity import ResponseAffinity
from radixserve.version import __version__

FAN_OUT_TIMEOUT_S = 10.0
logger = logging.getLogger(__name__)
HEALTH_GENERATE_TIMEOUT_S = 35.0


async def _ask_all(router: Router, method: str, path: str, timeout: float = FAN_OUT_TIMEOUT_S, **kw: Any):
    """(replica, response or exception) for every live replica, asked concurrently."""
    replicas = router.alive()

    async def one(r: Replica) -> httpx.Response | Exception:
        try:
            return await r.client.request(method, path, timeout=timeout, **kw)
        except Exception as e:
            return e

    return list(zip(replicas, await asyncio.gather(*(one(r) for r in replicas)), strict=True))


def create_router_app(router: Router, config: Config, metrics: RouterMetrics) -> FastAPI:
    app = FastAPI(title="RadixServe router", version=__version__, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.router = router
    install_error_handlers(app)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await forward(router, request)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await forward(router, request)

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        return await forward(router, request)

    affinity = ResponseAffinity()
    app.state.response_affinity = affinity
    router.on_replica_died.append(affinity.forget_replica)

    def owner_of(response_id: Any) -> Replica | None:
        index = affinity.owner(response_id) if isinstance(response_id, str) else None
        return None if index is None else router.replicas[index]

    @app.post("/v1/responses")
    async def create_response(request: Request) -> Response:
        data = _json(await request.body())
        previous = data.get("previous_response_id") if isinstance(data, dict) else None
        # an unknown previous response: the policy's replica answers the 404 (or the body's 400)
        return await forward(router, request, owner=owner_of(previous), observer=affinity)

    @app.api_route("/v1/responses/{response_id}", methods=["GET", "DELETE"])
    async def stored_response(response_id: str, request: Request) -> Response:
        owner = owner_of(response_id)
        if owner is None or not owner.alive:  # no replica holds it: one answers (its 404, or 400 for a bad query)
            return await forward_to_one(router, request)
        answer = await forward_to(owner, request)
        if request.method == "DELETE" and answer.status_code == 200:
            affinity.forget(response_id)
        return answer

    @app.api_route("/health", methods=["GET", "HEAD"])  # HEAD: load balancers' checks
    async def health() -> Response:
        """200 while at least one replica is in rotation and healthy; lists each replica."""
        if router.refusing is not None:
            return error_response("the router is not healthy: shutting down", 503)
        answers = dict(await _ask_all(router, "GET", "/health", timeout=5.0))
        replicas = [
            {
                "index": r.index,
                "healthy": isinstance(answers.get(r), httpx.Response) and answers[r].status_code == 200,
                **({"error": r.dead_reason} if r.dead_reason else {}),
            }
            for r in router.replicas
        ]
        if not any(x["healthy"] for x in replicas):
            return error_response("no replica is healthy", 503)
        return JSONResponse({"status": "ok", "replicas": replicas})

    @app.get("/health_generate")
    async def health_generate() -> Response:
        """200 only if every replica in rotation completes a one-token generation."""
        answers = await _ask_all(router, "GET", "/health_generate", timeout=HEALTH_GENERATE_TIMEOUT_S)
        bad = [
            f"replica {r.index}: {a.status_code if isinstance(a, httpx.Response) else type(a).__name__}"
            for r, a in answers
            if not (isinstance(a, httpx.Response) and a.status_code == 200)
        ]
        if bad or not answers:
            return error_response("health generation failed: " + ("; ".join(bad) or "no replica in rotation"), 503)
        return JSONResponse({"status": "ok", "replicas": len(answers)})

    @app.get("/metrics")
    async def prometheus() -> Response:
        texts = {
            r.index: a.text for r, a in await _ask_all(router, "GET", "/metrics")
            if isinstance(a, httpx.Response) and a.status_code == 200
        }  # fmt: skip
        for r in router.replicas:
            metrics.up.labels(str(r.index)).set(1 if r.alive else 0)
            metrics.in_flight.labels(str(r.index)).set(r.load)
        body = aggregate_replica_metrics(texts).encode() + metrics.render()
        return Response(body, media_type=CONTENT_TYPE)

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        answers = await _ask_all(router, "POST", "/flush_cache")
        failed = [(r.index, _refusal(a)) for r, a in answers if not (isinstance(a, httpx.Response) and a.status_code == 200)]
        router.policy.reset()  # what is left cached where is no longer known exactly: start afresh
        if failed:
            status = max(status for _, (status, _) in failed)
            raise APIError("; ".join(f"replica {index}: {message}" for index, (_, message) in failed), status)
        return JSONResponse({"status": "ok", "message": "cache flushed", "replicas": len(answers)})

    @app.post("/abort_request")
    async def abort_request(request: Request) -> Response:
        body = await request.body()
        answers = await _ask_all(router, "POST", "/abort_request", content=body,
                                 headers={"content-type": "application/json"})  # fmt: skip
        aborted = 0
        for _, a in answers:
            if isinstance(a, httpx.Response) and a.status_code != 200:
                return Response(a.content, status_code=a.status_code, media_type=a.headers.get("content-type"))
            if isinstance(a, httpx.Response):  # abort_all: each replica says how many it stopped
                with contextlib.suppress(ValueError, AttributeError):
                    aborted += int(a.json().get("aborted", 0))
        if _rid(body):
            return JSONResponse({"status": "ok", "rid": _rid(body)})
        return JSONResponse({"status": "ok", "aborted": aborted})

    @app.get("/server_info")
    @app.get("/get_server_info")  # SGLang's name, as on a single server
    async def server_info() -> JSONResponse:
        cfg = config.model_dump()
        if cfg["server"].get("api_key"):
            cfg["server"]["api_key"] = "***"
        answers = dict(await _ask_all(router, "GET", "/server_info"))
        replicas, stats = [], []
        for r in router.replicas:
            info: dict[str, Any] = {
                "index": r.index,
                "alive": r.alive,
                "pid": r.proc.pid,
                "address": f"unix:{r.socket_path}",
                "in_flight": r.load,
            }
            if r.dead_reason:
                info["error"] = r.dead_reason
            a = answers.get(r)
            if isinstance(a, httpx.Response) and a.status_code == 200:
                data = a.json()
                info.update(healthy=data.get("healthy"), stats=data.get("stats"))
                stats.append(data.get("stats"))
            replicas.append(info)
        first = next((answers[r].json() for r in router.alive() if isinstance(answers.get(r), httpx.Response)
                      and answers[r].status_code == 200), {})  # fmt: skip
        return JSONResponse(
            {
                "version": __version__,
                "model_name": first.get("model_name"),
                "context_len": first.get("context_len"),
                "healthy": router.refusing is None and any(x.get("healthy") for x in replicas),
                "dp_size": len(router.replicas),
                "router": {"policy": router.policy.name},
                "config": cfg,
                "resolved_stack": first.get("resolved_stack"),  # every replica runs the same config
                "stats": aggregate_stats(stats),
                "replicas": replicas,
            }
        )

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE"])
    async def other(request: Request) -> Response:
        return await forward_to_one(router, request)

    app.add_middleware(GuardMiddleware, api_key=config.server.api_key, max_bytes=config.server.max_request_bytes)
    app.add_middleware(RouterRefusalMiddleware, metrics=metrics, log_requests=config.server.log_requests)
    return app


class RouterRefusalMiddleware(ErrorStatusMiddleware):
    """Counts (radixserve_router_refused_requests_total{route,status}) and logs every generation request the
    router answered with an error without forwarding it (the API-key and size guards, a shutdown): a single
    server counts those in its requests_total, the replicas never see them. `forward` marks the requests it
    relays (the replica counts those)."""

    def __init__(self, app, metrics: RouterMetrics, log_requests: bool) -> None:
        super().__init__(app)
        self.metrics = metrics
        self.log_requests = log_requests

    def failed(self, route: str, status: int, latency_s: float, scope: dict, reason: str) -> None:
        if scope.get("state", {}).get(FORWARDED):
            return
        self.metrics.refused_total.labels(route, str(status)).inc()
        if self.log_requests:
            logger.info("request - %s status=%d latency=%.3fs client=%s (refused by the router): %s", route, status,
                        latency_s, client_of(scope), reason or "(no error message)")


def _json(body: bytes) -> Any:
    try:
        return json.loads(body)
    except ValueError:
        return None


def _rid(body: bytes) -> Any:
    data = _json(body)
    return data.get("rid") if isinstance(data, dict) else None


def _refusal(answer: Any) -> tuple[int, str]:
    """(status, message) of a replica's failed /flush_cache: its own error, or why it gave none."""
    if not isinstance(answer, httpx.Response):
        return 502, f"no answer ({type(answer).__name__}: {answer})"
    try:
        return answer.status_code, str(answer.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return answer.status_code, answer.text[:200]
