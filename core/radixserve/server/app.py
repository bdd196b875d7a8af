"""The FastAPI application: OpenAI routes, native routes, health, metrics, and plugin routes.

`create_app(tm, config)` builds the app around an already started TokenizerManager; it neither
starts nor stops the manager (launch.py owns its lifetime)."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from radixserve.config import Config
from radixserve.server import protocol as p
from radixserve.server import tokenization
from radixserve.server.auth import GuardMiddleware
from radixserve.server.errors import APIError, error_response, install_error_handlers, model_not_found
from radixserve.server.generation import ClientGone
from radixserve.server.metrics import CONTENT_TYPE, FailedRequestMiddleware, ServerMetrics
from radixserve.server.openai_serving import Serving
from radixserve.server.parser_selection import select_output_parsers
from radixserve.server.responses import add_responses_routes
from radixserve.server.runtime_api import GenerateInput, RequestError
from radixserve.state import SamplingParams
from radixserve.version import __version__

logger = logging.getLogger("radixserve.server")

HEALTH_GENERATE_TIMEOUT_S = 30.0


def create_app(tm: Any, config: Config, registry: Any = None) -> FastAPI:
    """`registry`: the process's plugin registry whose plugins may add routes (None: built from
    `config`)."""
    if registry is None:
        from radixserve.plugins.registry import Registry

        registry = Registry.from_config(config)
    app = FastAPI(title="RadixServe", version=__version__, docs_url=None, redoc_url=None, openapi_url=None)
    metrics = ServerMetrics(tm.model_name)
    parsers = select_output_parsers(config, registry, getattr(tm.tokenizer, "chat_template", None))
    serving = Serving(tm, metrics, log_requests=config.server.log_requests, parsers=parsers)
    app.state.tm = tm
    app.state.metrics = metrics
    app.state.serving = serving
    install_error_handlers(app)

    @app.exception_handler(RequestError)
    async def _request_error(_: Request, exc: RequestError) -> JSONResponse:
        status = int(getattr(exc, "status", 400))
        return error_response(str(getattr(exc, "message", exc)), status, getattr(exc, "param", None),
                              getattr(exc, "code", None))  # e.g. context_length_exceeded

    @app.exception_handler(ClientGone)
    async def _gone(_: Request, __: ClientGone) -> Response:
        return Response(status_code=499)  # nginx's "client closed request": nobody reads it

    # ---- OpenAI ----------------------------------------------------------------------------

    @app.post("/v1/chat/completions")
    async def chat_completions(body: p.ChatCompletionRequest, request: Request) -> Response:
        return await serving.chat(body, request)

    @app.post("/v1/completions")
    async def completions(body: p.CompletionRequest, request: Request) -> Response:
        return await serving.completions(body, request)

    served_since = int(time.time())  # the card's `created`: the same on every call, as OpenAI's

    def _card() -> p.ModelCard:
        return p.ModelCard(id=tm.model_name, created=served_since, root=tm.model_name, max_model_len=int(tm.context_len))

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse(p.ModelList(data=[_card()]).model_dump())

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> JSONResponse:
        if model != tm.model_name:
            raise model_not_found(f"the model {model!r} does not exist; this server serves {tm.model_name!r}")
        return JSONResponse(_card().model_dump())

    app.state.responses = add_responses_routes(app, serving)  # /v1/responses, on the chat route's serving

    @app.api_route("/v1/embeddings", methods=["GET", "POST"])
    async def not_served(request: Request) -> Response:
        """OpenAI routes this server does not have: a 404 that says so, where a bare "Not Found" read like a
        wrong model name through the SDKs (migration audit 31)."""
        raise APIError(f"this server has no embeddings API ({request.url.path}): it serves /v1/chat/completions, "
                       "/v1/completions and /v1/responses", 404)

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": __version__})  # vLLM's route: tooling reads it at connect

    # ---- native ------------------------------------------------------------------------------

    @app.post("/generate")
    async def generate(body: p.GenerateRequest, request: Request) -> Response:
        return await serving.generate(body, request)

    def unhealthy() -> Response:
        # why, where known: a load balancer's log then tells a shutdown from a crash
        why = getattr(tm, "unhealthy_reason", None)
        reason = (why() if why is not None else None) or "the runtime is not healthy"
        return error_response(reason, 503)

    @app.post("/tokenize")
    async def tokenize(body: p.TokenizeRequest) -> JSONResponse:
        return JSONResponse(await tokenization.tokenize(serving, body))

    @app.post("/detokenize")
    async def detokenize(body: p.DetokenizeRequest) -> JSONResponse:
        return JSONResponse(tokenization.detokenize(serving, body))

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> JSONResponse:
        return JSONResponse(tokenization.tokenizer_info(serving))

    @app.get("/get_model_info")
    async def model_info() -> JSONResponse:
        """SGLang's: what its clients (e.g. the `sglang` frontend's RuntimeEndpoint) read at connect."""
        return JSONResponse({"model_path": config.model.path, "tokenizer_path": config.model.tokenizer or config.model.path,
                             "served_model_name": tm.model_name, "is_generation": True,
                             "max_model_len": int(tm.context_len)})

    @app.api_route("/health", methods=["GET", "HEAD"])  # HEAD: load balancers' checks
    async def health() -> Response:
        if not tm.is_healthy():
            return unhealthy()
        return JSONResponse({"status": "ok"})

    @app.get("/health_generate")
    async def health_generate() -> Response:
        """Healthy only if a one-token generation completes within the timeout."""
        if not tm.is_healthy():
            return unhealthy()
        params = SamplingParams(max_new_tokens=1, temperature=0.0)
        gen = GenerateInput(text="ping", sampling_params=params, rid=f"health-{id(params)}", stream=False)

        async def one() -> None:
            async for _ in tm.generate(gen):
                pass

        try:
            await asyncio.wait_for(one(), HEALTH_GENERATE_TIMEOUT_S)
        except Exception as e:
            tm.abort(gen.rid)
            return error_response(f"health generation failed: {type(e).__name__}: {e}", 503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus() -> Response:
        try:
            metrics.update_stats(await tm.get_stats())
        except Exception:  # a dead runtime must not hide the server's own metrics
            logger.debug("scheduler stats unavailable for /metrics", exc_info=True)
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> JSONResponse:
        reply = await tm.flush_cache()
        if not reply.ok:
            raise APIError(reply.data.get("message", "the cache was not flushed"), int(reply.data.get("status", 400)))
        return JSONResponse({"status": "ok", "message": "cache flushed"})

    @app.post("/abort_request")
    async def abort_request(body: p.AbortRequest) -> JSONResponse:
        if body.abort_all:
            return JSONResponse({"status": "ok", "aborted": tm.abort_all()})
        serving.abort(body.rid)
        return JSONResponse({"status": "ok", "rid": body.rid})

    @app.get("/server_info")
    @app.get("/get_server_info")  # SGLang's name
    async def server_info() -> JSONResponse:
        cfg = config.model_dump()
        if cfg["server"].get("api_key"):
            cfg["server"]["api_key"] = "***"
        try:
            stats = await tm.get_stats()
        except Exception as e:
            stats = {"error": str(e)}
        return JSONResponse(
            {
                "version": __version__,
                "model_name": tm.model_name,
                "context_len": int(tm.context_len),
                "healthy": bool(tm.is_healthy()),
                "config": cfg,
                # the components running, with their distributions and options (the scheduler's, at start-up)
                "resolved_stack": (getattr(tm, "server_info", None) or {}).get("resolved_stack"),
                "stats": stats,
            }
        )

    _add_plugin_routes(app, tm, registry)
    # guards run before routing, so a bad key never reaches a handler
    app.add_middleware(GuardMiddleware, api_key=config.server.api_key, max_bytes=config.server.max_request_bytes)
    # outermost: sees every refusal, the guards' included
    app.add_middleware(FailedRequestMiddleware, metrics=metrics, log_requests=config.server.log_requests)
    return app


def _add_plugin_routes(app: FastAPI, tm: Any, registry: Any) -> None:
    before = len(app.routes)
    core = {getattr(route, "path", None) for route in app.routes}
    registry.hook.radixserve_add_routes(app=app, context=tm)
    clash = [r.path for r in app.routes[before:] if getattr(r, "path", None) in core]
    if clash:
        raise RuntimeError(f"a plugin tried to replace core routes: {sorted(set(clash))}")
