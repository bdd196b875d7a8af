"""Request guards as one pure-ASGI middleware: the API key and the request body size limit.

Pure ASGI (not BaseHTTPMiddleware) so that `receive` stays the server's own after the body is
read: the handlers watch it for the client's disconnect. The body is read here, checked against
the limit (413), and replayed to the app."""

from __future__ import annotations

import hmac
import json

from radixserve.server.errors import error_body

# Reachable without the API key: liveness probes must not need a secret.
OPEN_PATHS = frozenset({"/health"})


async def _send_error(send, status: int, message: str, extra_headers: list | None = None) -> None:
    body = json.dumps(error_body(message, status)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers + (extra_headers or [])})
    await send({"type": "http.response.body", "body": body})


def _presented_key(headers: list[tuple[bytes, bytes]]) -> bytes | None:
    for name, value in headers:
        if name == b"authorization":
            scheme, _, token = value.partition(b" ")
            if scheme.lower() == b"bearer":
                return token.strip()
        elif name == b"x-api-key":
            return value.strip()
    return None


class GuardMiddleware:
    """Rejects requests without the right API key (401), bodies over `max_bytes` (413) and bodies in
    another encoding than UTF-8 (400: Python's JSON parser would read UTF-16 and UTF-32 as well)."""

    def __init__(self, app, api_key: str | None, max_bytes: int) -> None:
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = scope.get("headers", [])
        if self.api_key is not None and scope.get("path") not in OPEN_PATHS:
            presented = _presented_key(headers)
            # compare_digest: the time taken does not reveal how much of the key matched
            if presented is None or not hmac.compare_digest(presented, self.api_key):
                await _send_error(send, 401, "invalid or missing API key", [(b"www-authenticate", b"Bearer")])
                return
        for name, value in headers:
            if name == b"content-length" and value.isdigit() and int(value) > self.max_bytes:
                await _send_error(send, 413, f"request body exceeds the limit of {self.max_bytes} bytes")
                return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # disconnected while sending the body
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await _send_error(send, 413, f"request body exceeds the limit of {self.max_bytes} bytes")
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        head = b"".join(chunks[:4])[:4]
        encoding = json.detect_encoding(head) if head else "utf-8"
        if encoding not in ("utf-8", "utf-8-sig"):  # the JSON parser would decode UTF-16/32 on its own
            await _send_error(send, 400, f"request body is not valid JSON: it is not UTF-8 (it reads as {encoding}; "
                                         "JSON on the wire is UTF-8)")
            return
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)
