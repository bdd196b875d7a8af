"""`radixserve serve --dp 2`: two SmolLM2 replicas (1 CPU thread each) behind the router.

What a user relies on: answers through the router are the replicas' own (streams included);
cache-aware routing reuses the replicas' prefix caches more than round-robin on a shared-prefix
workload (measured by the replicas' own cache counters; round-robin's assignment is replayed on
the same replicas, benchmarks/dp_router_cpu.py runs a round_robin router); a replica that dies fails only its own
in-flight requests, at once, and the other keeps serving; SIGTERM ends the router and every
replica with exit 0."""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest
from server_process import ServerProcess, descendant_pids, is_alive

START_TIMEOUT_S = 600
GRACE_S = 2.0
GROUPS = 3  # shared prefixes; with 2 replicas and the groups interleaved, round-robin splits each group
QUESTIONS = 4


class DPServer(ServerProcess):
    def __init__(self, policy: str, log_path: Path) -> None:
        args = [
            "--dp", "2", "--router-policy", policy, "runtime.num_threads=1", "scheduler.cpu_kv_cache_gb=0.25",
            f"server.shutdown_grace_s={GRACE_S}", "server.log_requests=false",
        ]  # fmt: skip
        super().__init__(args, log_path, START_TIMEOUT_S, new_session=True)
        self.model = httpx.get(f"{self.url}/v1/models", timeout=30).json()["data"][0]["id"]

    def info(self) -> dict:
        return httpx.get(f"{self.url}/server_info", timeout=30).json()

    def kill_leftovers(self, pids: list[int]) -> None:
        for pid in pids:
            if is_alive(pid):
                os.kill(pid, signal.SIGKILL)


def _prompts() -> list[tuple[int, str]]:
    """(group, prompt): GROUPS long shared prefixes, each followed by QUESTIONS short questions,
    interleaved A B C A B C ..."""
    rng = random.Random(0)
    words = "river stone lamp garden copper window violin harbor meadow pencil glacier orchard".split()
    prefixes = [f"Reference document {g}. " + " ".join(rng.choice(words) for _ in range(110)) for g in range(GROUPS)]
    return [
        (g, f"{prefixes[g]}\nQuestion {q}: which word comes first?") for q in range(QUESTIONS) for g in range(GROUPS)
    ]


def _hit_rate(srv: DPServer, send) -> float:
    """Prompt tokens served from the replicas' prefix caches over all prompt tokens (the replicas'
    own counters, aggregated by the router), for the workload sent one request at a time by
    `send(index, body)` on flushed caches."""
    assert httpx.post(f"{srv.url}/flush_cache", timeout=30).status_code == 200
    before = srv.info()["stats"]
    for i, (_, prompt) in enumerate(_prompts()):
        r = send(i, {"model": srv.model, "prompt": prompt, "max_tokens": 1, "temperature": 0})
        assert r.status_code == 200, r.text
    after = srv.info()["stats"]
    cached = after["prefill_tokens_cached"] - before["prefill_tokens_cached"]
    computed = after["prefill_tokens_computed"] - before["prefill_tokens_computed"]
    assert cached + computed > 0
    return cached / (cached + computed)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = DPServer("cache_aware", tmp_path_factory.mktemp("dp-ca") / "server.log")
    family = descendant_pids(srv.proc.pid)
    yield srv
    srv.stop()
    srv.kill_leftovers(family)


def test_cache_aware_routing_gets_a_higher_cache_hit_rate_than_round_robin(server):
    cache_aware = _hit_rate(server, lambda i, body: httpx.post(f"{server.url}/v1/completions", json=body, timeout=120))
    # round-robin, as RoundRobin routes (test_dp_routing): request i to replica i % 2, sent to the
    # replicas' own sockets so that one server (not a second one started for it) measures both
    clients = [_replica_client(r["address"]) for r in server.info()["replicas"]]
    try:
        round_robin = _hit_rate(server, lambda i, body: clients[i % 2].post("/v1/completions", json=body, timeout=120))
    finally:
        for c in clients:
            c.close()
    # cache_aware computes each shared prefix once; round-robin once on each replica
    assert cache_aware > round_robin + 0.1, (cache_aware, round_robin)
    routed = httpx.get(f"{server.url}/metrics", timeout=30).text
    assert 'radixserve_router_routed_requests_total{reason="cache_hit"' in routed


def _replica_client(address: str) -> httpx.Client:
    assert address.startswith("unix:")
    return httpx.Client(transport=httpx.HTTPTransport(uds=address[len("unix:") :]), base_url="http://replica")


def _sse_text(lines: list[str]) -> str:
    text = ""
    for line in lines:
        if line.startswith("data: ") and line != "data: [DONE]":
            event = json.loads(line[len("data: ") :])
            assert "error" not in event, event
            text += event["choices"][0]["text"]
    return text


def test_answers_through_the_router_are_the_replicas_own_streams_included(server):
    body = {"model": server.model, "prompt": "The three primary colors are", "max_tokens": 12, "temperature": 0}
    via_router = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]
    for replica in server.info()["replicas"]:
        with _replica_client(replica["address"]) as direct:
            own = direct.post("/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]
        assert own == via_router, (replica["index"], own, via_router)
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and _sse_text(lines) == via_router
    # errors come back in the OpenAI shape with the replica's status
    bad = httpx.post(f"{server.url}/v1/completions", json={"model": server.model, "prompt": "x", "max_tokens": -1},
                     timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens", bad.text


def test_metrics_and_server_info_cover_every_replica(server):
    info = server.info()
    assert info["dp_size"] == 2 and info["router"]["policy"] == "cache_aware" and info["healthy"]
    assert [r["index"] for r in info["replicas"]] == [0, 1] and all(r["healthy"] for r in info["replicas"])
    per_replica = [r["stats"]["prefill_tokens_cached"] for r in info["replicas"]]
    assert info["stats"]["prefill_tokens_cached"] == sum(per_replica)
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    for label in ('replica="0"', 'replica="1"', 'replica="all"'):
        assert f'radixserve_scheduler_prefill_tokens_cached{{model="{server.model}",{label}}}' in text
    assert 'radixserve_router_replica_up{replica="1"} 1.0' in text
    health = httpx.get(f"{server.url}/health", timeout=30).json()
    assert [r["healthy"] for r in health["replicas"]] == [True, True]


def test_a_client_that_disconnects_aborts_its_request_in_the_replica(server):
    before = server.info()["stats"]["aborted_requests"]
    body = {"model": server.model, "prompt": "Count to a million:", "max_tokens": 3000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):  # not streaming: nothing arrives before the end
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=2)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        info = server.info()
        if info["stats"]["aborted_requests"] > before and all(r["in_flight"] == 0 for r in info["replicas"]):
            return
        time.sleep(0.2)
    raise AssertionError(f"the replica did not abort the abandoned request: {info['stats']}")


def test_abort_all_through_the_router_stops_the_requests_of_every_replica(server):
    """SGLang's {"abort_all": true} (audit 37b): the router asks each replica and adds up what they stopped."""
    body = {"model": server.model, "prompt": "Count to a million:", "max_tokens": 3000, "ignore_eos": True}
    answers: list = []
    waiting = [threading.Thread(target=lambda: answers.append(httpx.post(f"{server.url}/v1/completions", json=body,
                                                                          timeout=120))) for _ in range(2)]
    for t in waiting:
        t.start()
    deadline = time.monotonic() + 30
    while sum(r["in_flight"] for r in server.info()["replicas"]) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    r = httpx.post(f"{server.url}/abort_request", json={"abort_all": True}, timeout=30)
    assert r.status_code == 200 and r.json() == {"status": "ok", "aborted": 2}, r.text
    for t in waiting:
        t.join(60)
    assert [a.json()["choices"][0]["finish_reason"] for a in answers] == ["abort", "abort"], [a.text for a in answers]


class _Stream(threading.Thread):
    def __init__(self, url: str, body: dict) -> None:
        super().__init__(daemon=True)
        self.url, self.body = url, body
        self.lines: list[str] = []
        self.first = threading.Event()
        self.ended_at: float | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with httpx.stream("POST", f"{self.url}/v1/completions", json=self.body, timeout=120) as r:
                for line in r.iter_lines():
                    if line:
                        self.lines.append(line)
                        self.first.set()
        except BaseException as e:
            self.error = e
        finally:
            self.ended_at = time.monotonic()
            self.first.set()

    def last_event(self) -> dict:
        assert self.lines[-1] == "data: [DONE]", self.lines[-3:]
        return json.loads(self.lines[-2][len("data: ") :])


def _routed(server: DPServer) -> dict[int, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    out: dict[int, float] = {0: 0.0, 1: 0.0}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "radixserve_router_routed_requests_total":
                out[int(s.labels["replica"])] += s.value
    return out


def test_a_killed_replica_fails_its_own_requests_fast_and_the_other_keeps_serving(server):
    prompts = dict(_prompts())
    body = lambda g, n: {  # noqa: E731
        "model": server.model, "prompt": prompts[g], "max_tokens": n, "ignore_eos": True, "temperature": 0,
        "stream": True,
    }  # fmt: skip
    # group 0 twice (long: still running at the kill), then the other groups (short); each group
    # goes where its prefix is cached, and at least one other group lives on the other replica
    streams: list[tuple[_Stream, int]] = []
    for g, n in [(0, 2000), (0, 2000)] + [(g, 48) for g in range(1, GROUPS)]:
        before = _routed(server)
        s = _Stream(server.url, body(g, n))
        s.start()
        assert s.first.wait(120)
        after = _routed(server)
        streams.append((s, next(i for i in after if after[i] > before[i])))
    victim = streams[0][1]
    assert streams[1][1] == victim and any(replica != victim for _, replica in streams)
    pid = next(r["pid"] for r in server.info()["replicas"] if r["index"] == victim)

    killed_at = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    for s, replica in streams:
        s.join(120)
        assert s.error is None and s.ended_at is not None
        last = s.last_event()
        if replica != victim:  # untouched by the kill
            assert last["choices"][0]["finish_reason"] == "length" and _sse_text(s.lines[:-2])
        elif "error" in last or s.body["max_tokens"] == 2000:
            assert s.ended_at - killed_at < 5, "a request on the dead replica did not fail fast"
            assert last["error"]["code"] == "502" and f"replica {victim}" in last["error"]["message"]
    # after the kill every request goes to the survivor, the dead replica's prefix included
    for g in range(GROUPS):
        r = httpx.post(f"{server.url}/v1/completions", json={**body(g, 4), "stream": False}, timeout=120)
        assert r.status_code == 200, r.text
    health = httpx.get(f"{server.url}/health", timeout=30)
    assert health.status_code == 200
    assert {r["index"]: r["healthy"] for r in health.json()["replicas"]} == {victim: False, 1 - victim: True}
    metrics = httpx.get(f"{server.url}/metrics", timeout=30).text
    assert f'radixserve_router_replica_up{{replica="{victim}"}} 0.0' in metrics


def test_sigterm_ends_the_router_and_every_replica_with_exit_0(server):
    family = [p for p in descendant_pids(server.proc.pid) if is_alive(p)]
    stream = _Stream(server.url, {"model": server.model, "prompt": "Once", "max_tokens": 3000,
                                  "ignore_eos": True, "stream": True})  # fmt: skip
    stream.start()
    assert stream.first.wait(120)
    signalled = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    refused = httpx.post(f"{server.url}/v1/completions", json={"model": server.model, "prompt": "hi"}, timeout=10)
    assert refused.status_code == 503 and refused.json()["error"]["message"]
    assert refused.json()["error"]["code"] == "service_unavailable"
    code = server.proc.wait(GRACE_S + 30)
    took = time.monotonic() - signalled
    stream.join(10)
    log = server.logs()
    assert code == 0, log
    assert took <= GRACE_S + 8, f"exit took {took:.1f} s"
    assert "Traceback" not in log, log
    # replicas ignore the terminal's signals: uvicorn's "(Press CTRL+C to quit)" is left off their lines (the whole
    # log: its start-up lines are older than logs()'s last 5000 characters once the module's other tests ran)
    whole = server.log_path.read_text()
    assert "Uvicorn running on unix socket" in whole and "Press CTRL+C" not in whole
    assert "error" in stream.last_event()  # outlived the grace period: ended with an error event
    deadline = time.monotonic() + 5
    while any(is_alive(p) for p in family) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(is_alive(p) for p in family), "a replica or its child outlived the router"
