"""Forwarding one HTTP request to a replica and its answer back, server-sent events included.

Failure rules (never a hang, never a cut stream):
- the replica cannot be connected to (nothing was sent): it is taken out of rotation and the
  request goes to another replica;
- the replica fails or is ended while answering: a 502/503 in the OpenAI error shape, or, once a
  stream has started, a final `data: {"error": ...}` event and `data: [DONE]` (what a single
  server sends when a stream fails);
- the client goes away: the upstream request is closed, so the replica sees the disconnect and
  aborts the request (frees its KV)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from typing import Any, Protocol

import httpx
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from radixserve.server.errors import error_body, error_response
from radixserve.server.router.core import Flight, FlightEnded, Router
from radixserve.server.router.replicas import Replica
from radixserve.server.router.routing_text import routing_text

logger = logging.getLogger("radixserve.router")

_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
_FORWARDED_HEADERS = ("content-type", "accept")
FORWARDED = "radixserve_forwarded"  # request.state flag: the request went to a replica


def _sse_error(message: str, status: int) -> bytes:
    return f"data: {json.dumps(error_body(message, status))}\n\ndata: [DONE]\n\n".encode()


async def _next_chunk(it: AsyncIterator[bytes]) -> bytes | None:
    try:
        return await it.__anext__()
    except StopAsyncIteration:
        return None


async def _end_on_disconnect(request: Request, flight: Flight) -> None:
    """End `flight` when the client goes away before its answer is ready: closing the upstream
    request makes the replica abort the generation (and free its KV)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            flight.end("the client disconnected", 499)
            return


class AnswerObserver(Protocol):
    """Shown what a replica answered a forwarded request (response_affinity.ResponseAffinity)."""

    def seen_body(self, replica: int, status: int, content: bytes) -> None:
        """A whole non-streamed answer."""

    def seen_event(self, replica: int, event: bytes) -> bool:
        """One whole SSE event of a streamed answer, in order; True: no more events are needed."""


async def forward(
    router: Router, request: Request, owner: Replica | None = None, observer: AnswerObserver | None = None
) -> Response:
    """Route `request` to a replica chosen by the router's policy, or to `owner` (one that holds state the
    request needs) while it is in rotation and can be connected to, and relay the answer, shown to `observer`."""
    setattr(request.state, FORWARDED, True)  # a replica answers (and counts) it: app.RouterRefusalMiddleware
    body = await request.body()
    try:
        data: Any = json.loads(body) if body else None
    except ValueError:
        data = None  # the replica answers the 400
    path = request.url.path
    text = routing_text(path, data)
    headers = {k: v for k, v in request.headers.items() if k.lower() in _FORWARDED_HEADERS}
    tried: set[int] = set()
    while True:
        if owner is not None and owner.alive and owner.index not in tried:
            replica = router.pin(owner, "owner")
        else:
            replica, _ = router.pick(text, exclude=tried)
        flight = router.open_flight(replica)
        watcher = asyncio.ensure_future(_end_on_disconnect(request, flight))
        upstream = replica.client.build_request(
            request.method, path, content=body, headers=headers, params=request.query_params
        )
        try:
            resp = await flight.race(replica.client.send(upstream, stream=True))
            break
        except httpx.ConnectError as e:  # nothing reached the replica: another one takes it
            watcher.cancel()
            router.close_flight(flight)
            tried.add(replica.index)
            if replica.proc.poll() is not None:
                router.replica_died(replica, f"exited with code {replica.proc.returncode} ({e})")
        except FlightEnded as e:
            watcher.cancel()
            router.close_flight(flight)
            return error_response(e.message, e.status)
        except httpx.HTTPError as e:
            watcher.cancel()
            router.close_flight(flight)
            return error_response(f"replica {replica.index} failed: {type(e).__name__}: {e}", 502)
        except BaseException:
            watcher.cancel()
            router.close_flight(flight)
            raise
    if "text/event-stream" in resp.headers.get("content-type", ""):
        watcher.cancel()  # from here Starlette watches the client itself (and cancels the relay)
        return StreamingResponse(
            _relay_events(router, flight, resp, observer), status_code=resp.status_code, media_type="text/event-stream",
            headers=_SSE_HEADERS,
        )  # fmt: skip
    try:
        content = await flight.race(resp.aread())
    except FlightEnded as e:
        return error_response(e.message, e.status)
    except httpx.HTTPError as e:
        return error_response(f"replica {replica.index} failed: {type(e).__name__}: {e}", 502)
    finally:
        watcher.cancel()
        with contextlib.suppress(Exception):
            await resp.aclose()
        router.close_flight(flight)
    if observer is not None:
        observer.seen_body(replica.index, resp.status_code, content)
    return Response(content, status_code=resp.status_code, media_type=resp.headers.get("content-type"))


async def _relay_events(
    router: Router, flight: Flight, resp: httpx.Response, observer: AnswerObserver | None = None
) -> AsyncIterator[bytes]:
    """Whole SSE events from the replica, then its end; an error event if it fails midway. Each event is
    shown to `observer` (before the client gets it) until it needs no more."""
    pending = b""
    chunks = resp.aiter_raw()
    try:
        while True:
            chunk = await flight.race(_next_chunk(chunks))
            if chunk is None:
                break
            pending += chunk
            *events, pending = pending.split(b"\n\n")
            for event in events:
                if observer is not None and observer.seen_event(flight.replica.index, event):
                    observer = None
                yield event + b"\n\n"
        if pending.strip():
            yield pending
    except FlightEnded as e:
        yield _sse_error(e.message, e.status)
    except httpx.HTTPError as e:
        yield _sse_error(f"replica {flight.replica.index} failed: {type(e).__name__}: {e}", 502)
    finally:
        with contextlib.suppress(Exception):
            await resp.aclose()
        router.close_flight(flight)


async def forward_to_one(router: Router, request: Request) -> Response:
    """A request that needs no routing decision (model list, plugin routes): the first live replica."""
    alive = router.alive()
    if not alive:
        return error_response("no replica is available", 503)
    return await forward_to(alive[0], request)


async def forward_to(replica: Replica, request: Request) -> Response:
    """A short request (no generation: read whole, no flight) to `replica`, and its answer."""
    try:
        r = await replica.client.request(
            request.method, request.url.path, content=await request.body(), params=request.query_params,
            headers={k: v for k, v in request.headers.items() if k.lower() in _FORWARDED_HEADERS},
        )  # fmt: skip
    except httpx.HTTPError as e:
        return error_response(f"replica {replica.index} failed: {type(e).__name__}: {e}", 502)
    return Response(r.content, status_code=r.status_code, media_type=r.headers.get("content-type"))
