"""Generation requests the data-parallel router refuses itself (API key, body size) are counted and logged, as a
single server counts them in requests_total; the replicas never see them (operator audit 34). Requests it
forwards are the replicas' to count."""

from __future__ import annotations

import logging

from fastapi.testclient import TestClient
from radixserve.config import Config
from radixserve.server.router.app import create_router_app
from radixserve.server.router.core import Router
from radixserve.server.router.metrics import RouterMetrics
from radixserve.server.router.policies import make_policy


def _client(**server) -> tuple[TestClient, RouterMetrics]:
    config = Config.build({"server": {"api_key": "k1", **server}})
    metrics = RouterMetrics()
    router = Router([], make_policy(config.router, 1), metrics)  # no replica: anything forwarded fails (a 503)
    return TestClient(create_router_app(router, config, metrics)), metrics


def test_the_routers_own_refusals_are_counted_and_logged(caplog):
    client, metrics = _client(max_request_bytes=1024)
    with caplog.at_level(logging.INFO, logger="radixserve.server.router.app"):
        assert client.post("/v1/chat/completions", json={"messages": []}).status_code == 401
        big = {"prompt": "x" * 4096}
        assert client.post("/v1/completions", json=big, headers={"Authorization": "Bearer k1"}).status_code == 413
        forwarded = client.post("/generate", json={"text": "hi"}, headers={"Authorization": "Bearer k1"})
    assert forwarded.status_code >= 500  # no replica answered it: not a refusal of the router's guards
    text = metrics.render().decode()
    assert 'radixserve_router_refused_requests_total{route="chat",status="401"} 1.0' in text, text
    assert 'radixserve_router_refused_requests_total{route="completions",status="413"} 1.0' in text
    assert 'route="generate"' not in text
    said = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("request - chat status=401 latency=") and "(refused by the router): " in m
               and "API key" in m for m in said), said
