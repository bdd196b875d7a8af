"""The Responses API (`/v1/responses`) through the data-parallel router, without processes: the replicas are
whole single-server apps on test_http_api's toy runtime, reached in-process (httpx's ASGI transport), each with
its own response store. POSTs are spread by the routing policy; `previous_response_id`, GET and DELETE reach
the replica that stored the response (read off its answer, streamed or not); an id no replica holds is the
replica's own 404; a dead replica's ids are forgotten; a stream is relayed event by event."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Iterator

import httpx
import pytest
from fastapi.testclient import TestClient
from radixserve.config import Config
from radixserve.server.app import create_app
from radixserve.server.router.app import create_router_app
from radixserve.server.router.core import Router
from radixserve.server.router.metrics import RouterMetrics
from radixserve.server.router.policies import make_policy
from radixserve.server.router.replicas import Replica
from radixserve.server.router.response_affinity import ResponseAffinity
from radixserve.server.router.routing_text import routing_text
from test_http_api import MODEL, FakeTM


class _Proc:
    pid = 0
    returncode = None

    def poll(self):
        return None


class DP:
    """A router (round-robin unless told) in front of `n` replica apps; `client` talks to the router."""

    def __init__(self, n: int, policy: str = "round_robin") -> None:
        self.apps = [create_app(FakeTM(context_len=4096), Config()) for _ in range(n)]
        self.replicas = [
            Replica(i, f"/nonexistent/{i}.sock", _Proc(),
                    httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://replica"))
            for i, app in enumerate(self.apps)
        ]  # fmt: skip
        config = Config.build({"router": {"policy": policy}})
        self.metrics = RouterMetrics()
        self.router = Router(self.replicas, make_policy(config.router, n), self.metrics)
        self.app = create_router_app(self.router, config, self.metrics)
        self.client = TestClient(self.app)

    def stored(self) -> list[list[str]]:
        """The ids in each replica's own store."""
        return [list(app.state.responses._entries) for app in self.apps]

    def post(self, **body) -> dict:
        r = self.client.post("/v1/responses", json={"model": MODEL, "max_output_tokens": 3, "temperature": 0, **body})
        assert r.status_code == 200, r.text
        return r.json()


@pytest.fixture
def dp() -> Iterator[DP]:
    d = DP(2)
    with d.client:  # one event loop for the whole test (the replicas' clients live on it)
        yield d


def _unknown_on_a_replica(response_id: str) -> httpx.Response:
    """What a single server answers for an id it does not hold."""
    return TestClient(create_app(FakeTM(), Config())).get(f"/v1/responses/{response_id}")


def test_posts_are_spread_over_the_replicas_by_the_policy(dp):
    ids = [dp.post(input=f"question {i}")["id"] for i in range(4)]
    assert dp.stored() == [[ids[0], ids[2]], [ids[1], ids[3]]]  # round-robin, as chat's requests
    text = dp.metrics.render().decode()
    assert 'radixserve_router_routed_requests_total{reason="round_robin",replica="1"} 2.0' in text, text


def test_previous_response_id_goes_to_the_replica_that_stored_it(dp):
    a = dp.post(input="first")
    b = dp.post(input="second")
    assert dp.stored() == [[a["id"]], [b["id"]]]
    # round-robin's turn is replica 0's; the conversation is on replica 1
    follow = dp.post(input="and then?", previous_response_id=b["id"])
    assert follow["previous_response_id"] == b["id"]
    again = dp.post(input="and after that?", previous_response_id=follow["id"])
    assert dp.stored() == [[a["id"]], [b["id"], follow["id"], again["id"]]]
    assert dp.post(input="new")["id"] in dp.stored()[0]  # the pins did not take the policy's turns
    text = dp.metrics.render().decode()
    assert 'radixserve_router_routed_requests_total{reason="owner",replica="1"} 2.0' in text, text
    # unknown to the router: the policy's replica answers its own 404, naming the field
    r = dp.client.post("/v1/responses", json={"model": MODEL, "input": "x", "previous_response_id": "resp_nope"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id", r.text


def test_get_and_delete_go_to_the_owner_and_an_unknown_id_is_the_replicas_404(dp):
    a = dp.post(input="first")
    b = dp.post(input="second")
    assert dp.stored() == [[a["id"]], [b["id"]]]
    for r in (a, b):
        got = dp.client.get(f"/v1/responses/{r['id']}")
        assert got.status_code == 200 and got.json() == r, got.text
    deleted = dp.client.delete(f"/v1/responses/{b['id']}")
    assert deleted.status_code == 200, deleted.text
    assert deleted.json() == {"id": b["id"], "object": "response.deleted", "deleted": True}
    assert dp.stored() == [[a["id"]], []]
    assert dp.app.state.response_affinity.owner(b["id"]) is None  # forgotten after the DELETE
    for method in ("GET", "DELETE"):
        for unknown in (b["id"], "resp_nope"):
            r = dp.client.request(method, f"/v1/responses/{unknown}")
            single = _unknown_on_a_replica(unknown)
            assert r.status_code == single.status_code == 404 and r.json() == single.json(), r.text
            assert r.json()["error"]["type"] == "invalid_request_error"
    assert dp.client.get(f"/v1/responses/{a['id']}").status_code == 200
    # an unknown id with a query the API does not serve: the single server's 400 (the router said 404)
    single = TestClient(create_app(FakeTM(), Config())).get("/v1/responses/resp_nope?stream=true")
    r = dp.client.get("/v1/responses/resp_nope?stream=true")
    assert r.status_code == single.status_code == 400 and r.json() == single.json(), r.text


def test_a_streamed_post_records_the_id_of_its_response_created_event(dp):
    first = dp.post(input="first")
    with dp.client.stream("POST", "/v1/responses", json={"model": MODEL, "input": "hi", "max_output_tokens": 3,
                                                         "stream": True}) as r:  # fmt: skip
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(line[len("data: "):]) for line in r.iter_lines() if line.startswith("data: ")]
    assert events[0]["type"] == "response.created" and events[-1]["type"] == "response.incomplete"  # 3 tokens
    streamed = events[0]["response"]["id"]
    assert dp.stored() == [[first["id"]], [streamed]]
    assert dp.client.get(f"/v1/responses/{streamed}").json() == events[-1]["response"]
    follow = dp.post(input="more", previous_response_id=streamed)
    assert follow["id"] in dp.stored()[1]


def test_a_dead_replicas_ids_are_forgotten(dp):
    a = dp.post(input="first")
    b = dp.post(input="second")
    assert dp.stored() == [[a["id"]], [b["id"]]]
    dp.router.replica_died(dp.replicas[0], "killed")
    affinity = dp.app.state.response_affinity
    assert affinity.owner(a["id"]) is None and affinity.owner(b["id"]) == 1
    # replica 0's app still answers here (in-process): a 404 shows the router no longer sends it there
    r = dp.client.get(f"/v1/responses/{a['id']}")
    assert r.status_code == 404 and r.json() == _unknown_on_a_replica(a["id"]).json(), r.text
    r = dp.client.post("/v1/responses", json={"model": MODEL, "input": "x", "previous_response_id": a["id"]})
    assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id", r.text
    assert dp.client.get(f"/v1/responses/{b['id']}").status_code == 200


# ---- a stream is relayed as it comes ----------------------------------------------------------------


def _sse(kind: str, seq: int, **fields) -> bytes:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': seq, **fields})}\n\n".encode()


def test_a_stream_is_relayed_as_it_comes_and_its_id_known_from_its_first_event():
    """The replica sends response.created and then waits: the client has that event, and the router the id,
    before the replica's stream ends."""
    release = asyncio.Event()

    def replica(index: int) -> Replica:
        async def events():
            response = {"id": f"resp_{index}", "object": "response", "status": "in_progress", "store": True}
            yield _sse("response.created", 0, response=response)
            await release.wait()
            yield _sse("response.completed", 1, response={**response, "status": "completed"})

        def answer(request: httpx.Request) -> httpx.Response:
            return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=events())

        client = httpx.AsyncClient(transport=httpx.MockTransport(answer), base_url="http://replica")
        return Replica(index, f"/nonexistent/{index}.sock", _Proc(), client)

    config = Config.build({"router": {"policy": "round_robin"}})
    router = Router([replica(0), replica(1)], make_policy(config.router, 2), RouterMetrics())
    app = create_router_app(router, config, RouterMetrics())

    async def run() -> list[bytes]:
        body = json.dumps({"model": MODEL, "input": "hi", "stream": True}).encode()
        scope = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
            "path": "/v1/responses", "raw_path": b"/v1/responses", "root_path": "", "query_string": b"",
            "headers": [(b"content-type", b"application/json"), (b"host", b"router")],
            "client": ("127.0.0.1", 1), "server": ("router", 80),
        }  # fmt: skip
        sent = [{"type": "http.request", "body": body, "more_body": False}]
        gone = asyncio.Event()
        chunks: list[bytes] = []
        got_one = asyncio.Event()

        async def receive():
            if sent:
                return sent.pop()
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            if message["type"] == "http.response.body" and message.get("body"):
                chunks.append(message["body"])
                got_one.set()

        task = asyncio.ensure_future(app(scope, receive, send))
        try:
            await asyncio.wait_for(got_one.wait(), 5)  # a buffering router sends nothing until the stream ends
            assert b"response.created" in chunks[0] and not release.is_set()
            assert app.state.response_affinity.owner("resp_0") == 0
            release.set()
            await asyncio.wait_for(task, 5)
        finally:
            gone.set()
            if not task.done():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
        return chunks

    chunks = asyncio.run(run())
    assert b"response.completed" in b"".join(chunks)


# ---- the bookkeeping and the routing text --------------------------------------------------------------


def test_the_id_map_is_bounded_per_replica_least_recently_used_first():
    aff = ResponseAffinity(max_per_replica=2)
    for rid, replica in (("a", 0), ("b", 0), ("x", 1)):
        aff.record(rid, replica)
    assert aff.owner("a") == 0  # used: "b" is now the oldest of replica 0
    aff.record("c", 0)
    assert [aff.owner(r) for r in ("a", "b", "c", "x")] == [0, None, 0, 1] and len(aff) == 3
    aff.forget("a")
    aff.forget_replica(1)
    assert aff.owner("a") is None and aff.owner("x") is None and len(aff) == 1
    # read off answers: only 200s that are stored response objects
    aff.seen_body(1, 200, json.dumps({"id": "resp_j", "object": "response", "store": True}).encode())
    aff.seen_body(1, 200, json.dumps({"id": "resp_n", "object": "response", "store": False}).encode())
    aff.seen_body(1, 404, json.dumps({"error": {"message": "no"}}).encode())
    aff.seen_body(1, 200, b"not json")
    assert aff.owner("resp_j") == 1 and aff.owner("resp_n") is None
    created = _sse("response.created", 0, response={"id": "resp_s", "object": "response", "store": True})
    assert aff.seen_event(0, created) is True and aff.owner("resp_s") == 0


def test_the_routing_text_of_a_response_is_that_of_the_chat_request_it_becomes():
    system = "You are a pirate. Answer briefly. " * 3
    chat = routing_text("/v1/chat/completions", {"messages": [
        {"role": "system", "content": system}, {"role": "user", "content": "Where is the rum?"}]})  # fmt: skip
    assert routing_text("/v1/responses", {"instructions": system, "input": "Where is the rum?"}) == chat
    items = {"instructions": system, "input": [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Where is the rum?"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}]}  # fmt: skip
    text = routing_text("/v1/responses", items)
    assert text.startswith(chat) and '"call_id": "c1"' in text
    assert routing_text("/v1/responses", {"input": 3}) == ""


def test_cache_aware_routing_keeps_each_shared_instructions_prefix_on_one_replica():
    d = DP(2, policy="cache_aware")
    librarian = "You are a librarian. Recommend exactly one book and say why, politely. " * 4
    pirate = "You are a pirate. Answer every question in pirate speech, briefly. " * 4
    groups: dict[str, list[str]] = {librarian: [], pirate: []}
    with d.client:
        for q in ("A mystery?", "A history of Rome?", "Poetry?"):  # interleaved: round-robin would split both
            for system, ids in groups.items():
                ids.append(d.post(instructions=system, input=q)["id"])
    assert sorted(d.stored()) == sorted(groups.values())
