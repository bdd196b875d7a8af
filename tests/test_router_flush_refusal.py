"""The router's /flush_cache passes on each refusing replica's own reason and status (it said "requests
running?" with a 400 for every refusal, a cache that could not be reset included)."""

from __future__ import annotations

import httpx
from radixserve.server.router.app import _refusal


def test_a_replicas_error_body_and_status_are_kept():
    body = {"error": {"message": "prefix cache 'x' failed to reset: RuntimeError: boom", "type": "internal_server_error"}}
    assert _refusal(httpx.Response(500, json=body)) == (500, "prefix cache 'x' failed to reset: RuntimeError: boom")
    assert _refusal(httpx.Response(400, text="not json")) == (400, "not json")
    status, message = _refusal(httpx.ConnectError("refused"))
    assert status == 502 and "ConnectError" in message
