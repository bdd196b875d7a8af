"""HTTP layer against a fake TokenizerManager (same API, deterministic toy outputs): fast tests
of routing, request validation, response shapes, streaming, errors, auth, limits and aborts.
The end-to-end tests on the real runtime are in test_http_e2e.py."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
import uvicorn
from fastapi.testclient import TestClient
from radixserve.config import Config
from radixserve.server.app import create_app
from radixserve.server.runtime_api import RequestError
from radixserve.validation import ModelLimits

MODEL = "fake-model"
VOCAB = 200  # the fake model's vocabulary: prompt ids 1..99, output ids 100..149


class FakeTokenizer:
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) % 50 + 1 for c in text]  # no special tokens to add

    def decode(self, ids: list[int]) -> str:
        return "".join(f"<{i}>" for i in ids)


class FakeTM:
    """Toy runtime: output token k of a prompt is a function of (prompt, seed, k); the text of token
    t is "<t>". Records aborts; `delay` paces streamed tokens."""

    def __init__(self, context_len: int = 64, delay: float = 0.0) -> None:
        self.tokenizer = FakeTokenizer()
        self.model_name = MODEL
        self.context_len = context_len
        self.delay = delay
        self.healthy = True
        self.aborted: list[str] = []
        self.inputs: list = []
        self.flushed = 0
        self.reject: RequestError | None = None  # raised by every generate (a runtime rejection)

    @property
    def limits(self) -> ModelLimits:
        return ModelLimits(vocab_size=VOCAB, context_len=self.context_len)

    def apply_chat_template(self, messages, add_generation_prompt=True):
        text = "".join(f"{m['role']}:{m['content']}{'+calls' if m.get('tool_calls') else ''}|" for m in messages)
        return self.tokenizer.encode(text) + ([99] if add_generation_prompt else [])

    def token(self, prompt: list[int], seed: int | None, k: int) -> int:
        return (sum(prompt) * 31 + k * 7 + (seed or 0) * 13) % 50 + 100

    async def generate(self, inp):
        self.inputs.append(inp)
        if self.reject is not None:
            raise self.reject
        sp = inp.sampling_params
        prompt = inp.input_ids if inp.input_ids is not None else self.tokenizer.encode(inp.text)
        if len(prompt) + sp.max_new_tokens > self.context_len:
            raise RequestError(f"too long: {len(prompt)} + {sp.max_new_tokens} > {self.context_len}", 400)
        out_ids: list[int] = []
        lps: list = []
        tops: list = []
        finish = None
        while finish is None:
            if inp.rid in self.aborted:
                finish = {"type": "abort"}
                break
            t = self.token(prompt, sp.seed, len(out_ids))
            out_ids.append(t)
            lps.append((-0.5 * len(out_ids), t))
            tops.append([(-0.5 * len(out_ids) - j, t + j) for j in range(sp.top_logprobs)])
            text = self.tokenizer.decode(out_ids)
            for s in sp.stop:
                if s in text:
                    text = text[: text.index(s)]
                    finish = {"type": "stop", "matched": s}
                    break
            if finish is None and t in sp.stop_token_ids:
                finish = {"type": "stop", "matched": t}
            if finish is None and len(out_ids) >= sp.max_new_tokens:
                finish = {"type": "length"}
            out = {
                "text": text if finish else self.tokenizer.decode(out_ids),
                "output_ids": list(out_ids),
                "meta_info": {
                    "id": inp.rid,
                    "prompt_tokens": len(prompt),
                    "completion_tokens": len(out_ids),
                    "cached_tokens": 2,
                    "finish_reason": finish,
                    "output_token_logprobs": list(lps) if inp.return_logprob else [],
                    "output_top_logprobs": list(tops) if inp.return_logprob else [],
                },
            }
            if inp.stream or finish:
                yield out
            if self.delay:
                await asyncio.sleep(self.delay)
            else:
                await asyncio.sleep(0)

    def abort(self, rid: str) -> None:
        self.aborted.append(rid)

    def abort_all(self) -> int:
        self.aborted.append("<all>")
        return 3

    async def flush_cache(self):
        from radixserve.messages import ControlReply

        self.flushed += 1
        return ControlReply(req_id=0)

    async def get_stats(self) -> dict:
        return {"num_running_reqs": 0, "num_waiting_reqs": 0, "token_usage": 0.25, "name": "x", "time": 1796609001.3}

    def is_healthy(self) -> bool:
        return self.healthy


def expected_text(tm: FakeTM, prompt: list[int], n_tokens: int, seed: int | None = None) -> str:
    return tm.tokenizer.decode([tm.token(prompt, seed, k) for k in range(n_tokens)])


@pytest.fixture
def tm() -> FakeTM:
    return FakeTM()


def make_client(tm: FakeTM, **server) -> TestClient:
    return TestClient(create_app(tm, Config.build({"server": server})))


@pytest.fixture
def client(tm) -> TestClient:
    return make_client(tm)


@pytest.fixture
def oai(client) -> openai.OpenAI:
    return openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=client, max_retries=0)


CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]


def chat_prompt(tm: FakeTM) -> list[int]:
    return tm.apply_chat_template(CHAT)


# ---- OpenAI routes through the real openai client --------------------------------------------


def test_models(oai, client):
    assert [m.id for m in oai.models.list().data] == [MODEL]
    r = client.get("/v1/models/other")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_chat_non_stream_text_and_usage(oai, tm):
    r = oai.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=5, temperature=0)
    prompt = chat_prompt(tm)
    assert r.choices[0].message.content == expected_text(tm, prompt, 5)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(prompt) and r.usage.completion_tokens == 5
    assert r.usage.total_tokens == len(prompt) + 5
    assert r.usage.prompt_tokens_details.cached_tokens == 2
    sp = tm.inputs[0].sampling_params
    assert sp.max_new_tokens == 5 and sp.temperature == 0.0


def test_chat_stream_equals_non_stream_and_usage(oai, tm):
    kw = dict(model=MODEL, messages=CHAT, max_tokens=6, seed=3)
    full = oai.chat.completions.create(**kw).choices[0].message.content
    chunks = list(oai.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full == expected_text(tm, chat_prompt(tm), 6, seed=3)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_n2_seeded_choices_differ_and_are_reproducible(oai, tm):
    kw = dict(model=MODEL, messages=CHAT, max_tokens=4, n=2, seed=7)
    a = oai.chat.completions.create(**kw)
    b = oai.chat.completions.create(**kw)
    texts = [c.message.content for c in sorted(a.choices, key=lambda c: c.index)]
    assert [c.index for c in a.choices] == [0, 1]
    assert texts[0] != texts[1]
    assert texts == [c.message.content for c in sorted(b.choices, key=lambda c: c.index)]
    assert a.usage.completion_tokens == 8 and a.usage.prompt_tokens == len(chat_prompt(tm))
    streamed = {0: "", 1: ""}
    for c in oai.chat.completions.create(stream=True, **kw):
        for ch in c.choices:
            streamed[ch.index] += ch.delta.content or ""
    assert [streamed[0], streamed[1]] == texts


def test_chat_logprobs(oai, tm):
    r = oai.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert [c.token for c in content] == [f"<{tm.token(chat_prompt(tm), None, k)}>" for k in range(3)]
    assert [c.logprob for c in content] == [-0.5, -1.0, -1.5]
    assert all(len(c.top_logprobs) == 2 for c in content)
    assert tm.inputs[-1].return_logprob and tm.inputs[-1].top_logprobs_num == 2
    streamed = []
    for c in oai.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=3, logprobs=True, top_logprobs=2, stream=True
    ):
        if c.choices and c.choices[0].logprobs:
            streamed += [x.logprob for x in c.choices[0].logprobs.content]
    assert streamed == [-0.5, -1.0, -1.5]


def test_chat_stop_string_and_extensions(oai, tm):
    prompt = chat_prompt(tm)
    full = expected_text(tm, prompt, 4)
    stop = full[8:11]  # inside the third token's text
    r = oai.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        max_tokens=4,
        stop=[stop],
        extra_body={"top_k": 5, "min_p": 0.1, "ignore_eos": True, "repetition_penalty": 1.2, "stop_token_ids": [7]},
    )
    assert r.choices[0].message.content == full[:8]
    assert r.choices[0].finish_reason == "stop"
    sp = tm.inputs[-1].sampling_params
    assert (sp.top_k, sp.min_p, sp.ignore_eos, sp.repetition_penalty, sp.stop_token_ids) == (5, 0.1, True, 1.2, [7])


def test_chat_default_max_tokens_fills_context(oai, tm):
    r = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])
    assert r.usage.prompt_tokens + r.usage.completion_tokens == tm.context_len


def test_completions_prompts_echo_logprobs(oai, tm):
    r = oai.completions.create(model=MODEL, prompt="abc", max_tokens=3, logprobs=2)
    assert r.choices[0].text == expected_text(tm, tm.tokenizer.encode("abc"), 3)
    lp = r.choices[0].logprobs
    assert lp.token_logprobs == [-0.5, -1.0, -1.5] and len(lp.top_logprobs[0]) == 2
    assert lp.text_offset == [0, 5, 10]
    r = oai.completions.create(model=MODEL, prompt=["ab", "cd"], max_tokens=2, n=2)
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    assert r.usage.prompt_tokens == 4 and r.usage.completion_tokens == 8
    r = oai.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=2, echo=True)
    assert r.choices[0].text == "<5><6><7>" + expected_text(tm, [5, 6, 7], 2)
    chunks = list(oai.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=2, echo=True, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_continuous_usage_stats_put_the_running_count_on_every_chunk(oai, tm, route):
    """Load generators count tokens per event with it (an event can carry several tokens)."""
    opts = {"include_usage": True, "continuous_usage_stats": True}
    if route == "completions":
        stream = oai.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=4, stream=True, stream_options=opts)
    else:
        msgs = [{"role": "user", "content": "hi"}]
        stream = oai.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, stream=True, stream_options=opts)
    counts = [c.usage.completion_tokens for c in stream if c.choices]
    assert counts == [1, 2, 3, 4]


def test_continuous_usage_stats_alone_still_ends_with_the_requests_total(oai, tm):
    """Stream audit 31: its chunks carry each choice's own count, and without include_usage no total came:
    with n=2 the last usage a client saw was one choice's."""
    stream = oai.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=4, n=2, stream=True,
                                    stream_options={"continuous_usage_stats": True})
    chunks = list(stream)
    assert max(c.usage.completion_tokens for c in chunks if c.choices) == 4  # per choice
    assert not chunks[-1].choices and chunks[-1].usage.completion_tokens == 8  # the request's


def test_include_usage_false_sends_no_chunk_with_empty_choices(oai, tm):
    """Audit 34: with include_usage given as false, continuous_usage_stats still ended the stream with a
    `choices: []` usage chunk, which vLLM never sends then (its clients read choices[0] of every chunk)."""
    stream = oai.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=3, stream=True,
                                    stream_options={"include_usage": False, "continuous_usage_stats": True})
    chunks = list(stream)
    assert chunks and all(c.choices for c in chunks)
    assert [c.usage.completion_tokens for c in chunks] == [1, 2, 3]  # the running counts stay


class CachingTM(FakeTM):
    """A prefix cache in the fake: a prompt's first generation finds nothing cached, every later one
    (a sibling choice of the same request, or a later request) all but its last token."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[tuple[int, ...]] = set()

    async def generate(self, inp):
        prompt = tuple(inp.input_ids if inp.input_ids is not None else self.tokenizer.encode(inp.text))
        cached = len(prompt) - 1 if prompt in self.seen else 0
        self.seen.add(prompt)
        async for out in super().generate(inp):
            out["meta_info"]["cached_tokens"] = cached
            yield out


def test_cached_tokens_count_each_prompt_once_as_prompt_tokens_do():
    """An outside audit: with n > 1 the siblings' hits on the prefix choice 0 had just computed were
    reported, so a cold prompt showed 58 of 59 tokens cached."""
    tm = CachingTM()
    oai = openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=make_client(tm), max_retries=0)
    opts = {"include_usage": True, "continuous_usage_stats": True}
    chat = dict(model=MODEL, messages=CHAT, max_tokens=3, n=3, seed=1)
    prompt = len(chat_prompt(tm))
    assert oai.chat.completions.create(**chat).usage.prompt_tokens_details.cached_tokens == 0
    tm.seen.clear()
    chunks = list(oai.chat.completions.create(stream=True, stream_options=opts, **chat))
    assert {c.usage.prompt_tokens_details.cached_tokens for c in chunks} == {0}, "every chunk, the last one too"
    # an earlier request cached it: each prompt's hit counts once
    assert oai.chat.completions.create(**chat).usage.prompt_tokens_details.cached_tokens == prompt - 1
    texts = dict(model=MODEL, prompt=["ab", "cde"], max_tokens=2, n=2, seed=1)
    assert oai.completions.create(**texts).usage.prompt_tokens_details.cached_tokens == 0
    tm.seen.clear()
    chunks = list(oai.completions.create(stream=True, stream_options=opts, **texts))
    assert {c.usage.prompt_tokens_details.cached_tokens for c in chunks} == {0}
    again = oai.completions.create(**texts).usage
    assert again.prompt_tokens == 5 and again.prompt_tokens_details.cached_tokens == 1 + 2


def test_completions_default_max_tokens_is_16(oai, tm):
    r = oai.completions.create(model=MODEL, prompt="a")
    assert r.usage.completion_tokens == 16


# ---- native routes ---------------------------------------------------------------------------


def test_native_generate(client, tm):
    r = client.post("/generate", json={"text": "ab", "sampling_params": {"max_new_tokens": 3, "temperature": 0}})
    assert r.status_code == 200
    assert r.json()["text"] == expected_text(tm, tm.tokenizer.encode("ab"), 3)
    assert r.json()["meta_info"]["completion_tokens"] == 3
    with client.stream(
        "POST", "/generate", json={"input_ids": [1, 2], "stream": True, "sampling_params": {"max_new_tokens": 3}}
    ) as s:
        events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert [len(json.loads(e)["output_ids"]) for e in events[:-1]] == [1, 2, 3]
    r = client.post("/generate", json={"text": "ab", "sampling_params": {"max_tokens": 3}})
    assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"]
    r = client.post("/generate", json={"text": "ab", "input_ids": [1]})
    assert r.status_code == 400


def test_refused_requests_are_counted_and_logged(tm, caplog):
    # requests refused before generating used to be in neither /metrics nor the request log
    client = make_client(tm, api_key="sekret", max_request_bytes=4096)
    auth = {"Authorization": "Bearer sekret"}
    with caplog.at_level("INFO", logger="radixserve.server.openai_serving"):
        assert client.post("/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": "5"},
                           headers=auth).status_code == 400  # a schema refusal
        assert client.post("/v1/completions", json={"model": MODEL, "prompt": "a", "logit_bias": {"-1": 1}},
                           headers=auth).status_code == 400  # a refusal of the runtime's checks
        assert client.post("/v1/completions", json={"model": "other", "prompt": "a"}, headers=auth).status_code == 404
        assert client.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT}).status_code == 401
        assert client.post("/generate", content=b"x" * 5000, headers=auth).status_code == 413
        assert client.post("/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": 2},
                           headers=auth).status_code == 200
    m = client.get("/metrics", headers=auth).text
    for route, status, n in (("completions", 400, 2), ("completions", 404, 1), ("chat", 401, 1),
                             ("generate", 413, 1), ("completions", 200, 1)):
        assert f'radixserve_requests_total{{model="fake-model",route="{route}",status="{status}"}} {n}.0' in m, m
    assert caplog.text.count("status=400") == 2 and "chat status=401" in caplog.text, caplog.text
    # each line says why and who (was: route, status and latency alone)
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("request - ")]
    bias = next(m for m in said if "logit_bias" in m)
    assert " client=testclient:" in bias and "status=400" in bias, said
    assert any("status=401" in m and "API key" in m for m in said), said
    assert any("status=413" in m and "bytes" in m for m in said), said


def test_health_metrics_flush_abort_info(tm):
    client = make_client(tm, api_key="sekret")
    assert client.get("/health").status_code == 200  # open without the key
    auth = {"Authorization": "Bearer sekret"}
    assert client.get("/health_generate", headers=auth).status_code == 200
    client.post("/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": 2}, headers=auth)
    m = client.get("/metrics", headers=auth).text
    assert 'radixserve_requests_total{model="fake-model",route="completions",status="200"} 1.0' in m
    assert 'radixserve_generation_tokens_total{model="fake-model"} 2.0' in m
    assert 'radixserve_scheduler_token_usage{model="fake-model"} 0.25' in m
    assert client.post("/flush_cache", headers=auth).status_code == 200 and tm.flushed == 1
    assert client.post("/abort_request", json={"rid": "r1"}, headers=auth).json()["status"] == "ok"
    assert tm.aborted == ["r1"]
    # SGLang's abort_all (audit 37b: a 400 "rid: Field required", so an SGLang client's cancel-all left them running)
    assert client.post("/abort_request", json={"abort_all": True}, headers=auth).json() == {"status": "ok", "aborted": 3}
    assert tm.aborted == ["r1", "<all>"]
    for body, param in (({}, "rid"), ({"rid": "r1", "abort_all": True}, "abort_all")):
        r = client.post("/abort_request", json=body, headers=auth)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    info = client.get("/server_info", headers=auth).json()
    assert info["model_name"] == MODEL and info["config"]["server"]["api_key"] == "***"


def test_an_idle_servers_metrics_have_every_model_series_at_zero(client):
    """Operator audit 30: before the first request the token counters, the in-flight gauge and the
    histograms had HELP/TYPE lines and no sample, so rate() and in-flight alerts saw absent series."""
    m = client.get("/metrics").text
    for line in ('radixserve_prompt_tokens_total{model="fake-model"} 0.0',
                 'radixserve_generation_tokens_total{model="fake-model"} 0.0',
                 'radixserve_cached_tokens_total{model="fake-model"} 0.0',
                 'radixserve_requests_in_flight{model="fake-model"} 0.0',
                 'radixserve_e2e_request_latency_seconds_count{model="fake-model"} 0.0',
                 'radixserve_time_to_first_token_seconds_count{model="fake-model"} 0.0',
                 # newcomer audit 34: the request counter had no sample (its route and status labels)
                 'radixserve_requests_total{model="fake-model",route="chat",status="200"} 0.0',
                 'radixserve_requests_total{model="fake-model",route="completions",status="200"} 0.0',
                 'radixserve_requests_total{model="fake-model",route="generate",status="200"} 0.0'):
        assert line in m, (line, m)
    assert "radixserve_scheduler_time" not in m  # the stats' read time is no statistic


def test_unhealthy_runtime_is_503(client, tm):
    tm.healthy = False
    assert client.get("/health").status_code == 503
    r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT})
    assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable_error"


# ---- bad input -------------------------------------------------------------------------------


def _chat(**kw):
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 2}
    body.update(kw)
    return {k: v for k, v in body.items() if v is not ...}


@pytest.mark.parametrize(
    "body,status,param",
    [
        (_chat(messages=...), 400, "messages"),
        (_chat(messages=[]), 400, "messages"),
        (_chat(temperature="hot"), 400, "temperature"),
        (_chat(max_tokens=-1), 400, "max_tokens"),
        (_chat(max_tokens=0), 400, "max_tokens"),
        (_chat(max_tokens=10**9), 400, "max_tokens"),
        (_chat(max_tokens=60), 400, "max_tokens"),  # fits alone, not with the prompt
        (_chat(n=0), 400, "n"),
        (_chat(top_logprobs=3), 400, "top_logprobs"),  # without logprobs=true
        (_chat(tools=[{"type": "function"}]), 400, "tools.0.function"),  # a tool without its function
        (_chat(messages=[{"role": "wizard", "content": "x"}]), 400, "messages.0.role"),
        (_chat(model="gpt-4"), 404, "model"),
    ],
)
def test_bad_chat_requests(client, body, status, param):
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param
    assert client.get("/health").status_code == 200


def test_bad_json_unknown_route_and_runtime_rejection(client):
    r = client.post("/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = client.post("/v1/chat/completions", json=[1, 2])
    assert r.status_code == 400
    r = client.get("/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    # a text prompt is tokenized at the edge: its budget is checked before anything runs
    for stream in (False, True):
        body = {"model": MODEL, "prompt": "x" * 60, "max_tokens": 10, "stream": stream}
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
        assert "exceeds the model's context length (64 tokens)" in r.json()["error"]["message"]


def test_a_runtime_rejection_becomes_the_response(tm, client):
    tm.reject = RequestError("request id 'x' is already in use", 400)
    for stream in (False, True):
        r = client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2, "stream": stream})
        assert r.status_code == 400 and r.json()["error"]["message"] == "request id 'x' is already in use"


def test_body_size_limit(tm):
    client = make_client(tm, max_request_bytes=1000)
    r = client.post("/v1/chat/completions", json=_chat(messages=[{"role": "user", "content": "x" * 2000}]))
    assert r.status_code == 413 and r.json()["error"]["message"].startswith("request body exceeds")

    def chunks():  # no content-length: the limit still holds for a chunked body
        for _ in range(10):
            yield b"x" * 200

    r = client.post("/v1/completions", content=chunks())
    assert r.status_code == 413
    assert client.post("/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": 1}).status_code == 200


def test_api_key(tm):
    client = make_client(tm, api_key="sekret")
    ok = openai.OpenAI(base_url="http://testserver/v1", api_key="sekret", http_client=client, max_retries=0)
    assert ok.models.list().data[0].id == MODEL
    bad = openai.OpenAI(base_url="http://testserver/v1", api_key="wrong", http_client=client, max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.chat.completions.create(model=MODEL, messages=CHAT)
    assert e.value.status_code == 401 and e.value.body["type"] == "authentication_error"
    assert e.value.body["code"] == "invalid_api_key"  # OpenAI's code (audit 30: it was "401")
    assert client.get("/metrics").status_code == 401
    assert client.get("/metrics", headers={"x-api-key": "sekret"}).status_code == 200


def test_plugin_routes_hook(tm):
    from radixserve.plugins import hookimpl
    from radixserve.plugins.registry import Registry

    class Plugin:
        @hookimpl
        def radixserve_add_routes(self, app, context):
            @app.get("/x/ping")
            async def ping():
                return {"model": context.model_name}

    registry = Registry.discover()  # the app gets its process's registry explicitly
    registry.pm.register(Plugin(), name="test-http-routes")
    client = TestClient(create_app(tm, Config(), registry))
    assert client.get("/x/ping").json() == {"model": MODEL}


# ---- client disconnect aborts (a real uvicorn server: TestClient cannot disconnect) ----------


@contextlib.contextmanager
def running(tm: FakeTM) -> Iterator[str]:
    """The app on `tm`, served by uvicorn on a free local port: yields its URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(tm, Config()), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 10
    while not server.started and time.time() < deadline:
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


@pytest.fixture
def live_server():
    tm = FakeTM(context_len=100000, delay=0.01)
    with running(tm) as url:
        yield tm, url


def _wait_for(cond, timeout=5.0) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return False


def test_disconnect_aborts_streaming_and_non_streaming(live_server):
    tm, url = live_server
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 5000, "stream": True, "rid": "s1"}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=10) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                break  # one event received; leaving the block closes the connection
    assert _wait_for(lambda: "s1" in tm.aborted), tm.aborted
    body.update(stream=False, rid="n1")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/v1/chat/completions", json=body, timeout=0.5)
    assert _wait_for(lambda: "n1" in tm.aborted), tm.aborted
    assert httpx.get(f"{url}/health").status_code == 200


def test_priority_is_a_request_field_of_every_generation_route(client, tm):
    """SGLang's `priority` extra field reaches the runtime (the `priority` policy orders by it)."""
    gen = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}, "priority": 7}
    assert client.post("/generate", json=gen).status_code == 200
    body = {"model": MODEL, "max_tokens": 2, "priority": -3}
    assert client.post("/v1/completions", json={**body, "prompt": "hi"}).status_code == 200
    assert client.post("/v1/chat/completions", json={**body, "messages": CHAT}).status_code == 200
    assert [i.priority for i in tm.inputs] == [7, -3, -3]
    bad = client.post("/generate", json={"input_ids": [1], "priority": "high"})
    assert bad.status_code == 400 and "priority" in bad.text


# ---- token ids against the vocabulary (issue 12: one bad id used to kill the server) ------------


@pytest.mark.parametrize(
    "route,body,param,message",
    [
        ("/v1/completions", {"prompt": [999999999]}, "prompt", "prompt[0] token id 999999999 is out of range [0, 200)"),
        ("/v1/completions", {"prompt": [5, -5]}, "prompt", "prompt[1] token id -5 is out of range [0, 200)"),
        ("/v1/completions", {"prompt": [[5], [6, 200]]}, "prompt[1]", "prompt[1][1] token id 200 is out of range"),
        ("/v1/completions", {"prompt": "hi", "logit_bias": {"200": 1}}, "logit_bias", "logit_bias key '200'"),
        ("/v1/completions", {"prompt": "hi", "logit_bias": {"-1": 1}}, "logit_bias", "logit_bias key '-1'"),
        ("/v1/completions", {"prompt": "hi", "logit_bias": {"abc": 1}}, "logit_bias", "keys must be token ids"),
        ("/v1/completions", {"prompt": "hi", "logit_bias": {"5": 101}}, "logit_bias", "in [-100, 100]"),
        ("/v1/completions", {"prompt": "hi", "stop_token_ids": [1, 99999]}, "stop_token_ids", "stop_token_ids[1]"),
        ("/v1/chat/completions", {"messages": CHAT, "stop_token_ids": [-1]}, "stop_token_ids", "token id -1"),
        ("/v1/chat/completions", {"messages": CHAT, "logit_bias": {"1000": 5}}, "logit_bias", "key '1000'"),
        ("/generate", {"input_ids": [200]}, "input_ids", "input_ids[0] token id 200 is out of range [0, 200)"),
        ("/generate", {"input_ids": [-5]}, "input_ids", "input_ids[0] token id -5"),
        (
            "/generate",
            {"text": "hi", "sampling_params": {"logit_bias": {"300": 1.0}}},
            "sampling_params.logit_bias",
            "key '300' is not a token id in [0, 200)",
        ),
        (
            "/generate",
            {"text": "hi", "sampling_params": {"stop_token_ids": [7, 1 << 40]}},
            "sampling_params.stop_token_ids",
            "sampling_params.stop_token_ids[1]",
        ),
        ("/generate", {"text": "hi", "sampling_params": {"stop_token_ids": "ab"}}, "sampling_params.stop_token_ids", ""),
        ("/generate", {"text": "hi", "sampling_params": {"stop": [1]}}, "sampling_params.stop",
         "sampling_params.stop must be a string or a list of strings, got [1]"),
        ("/generate", {"text": "hi", "sampling_params": {"temperature": "hot"}}, "sampling_params.temperature", ""),
        ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 1.5}}, "sampling_params.max_new_tokens", ""),
        ("/generate", {"text": "hi", "sampling_params": {"seed": 1 << 70}}, "sampling_params.seed", "64-bit"),
        ("/generate", {"text": "hi", "sampling_params": {"top_p": 1.5}}, "sampling_params.top_p", "top_p"),
    ],
)
def test_out_of_vocabulary_ids_are_400s_naming_the_field(tm, client, route, body, param, message):
    if route != "/generate":
        body = {"model": MODEL, "max_tokens": 2, **body}
    for stream in (False, True):
        r = client.post(route, json={**body, "stream": stream})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["param"] == param, err
        assert message in err["message"], err
    assert tm.inputs == [], "an invalid request reached the runtime"
    assert client.get("/health").status_code == 200


@pytest.mark.parametrize("encoding", ["utf-16", "utf-32", "utf-16-be"])
def test_a_body_in_another_encoding_than_utf8_is_a_400(client, tm, encoding):
    """Fuzz audit 31: Python's JSON parser read a UTF-16 body; http-api.md says a body must be UTF-8."""
    raw = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2}).encode(encoding)
    r = client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400 and "it is not UTF-8" in r.json()["error"]["message"], r.text
    assert tm.inputs == []
    bom = b"\xef\xbb\xbf" + json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2}).encode()
    assert client.post("/v1/completions", content=bom, headers={"content-type": "application/json"}).status_code == 200


def test_non_finite_numbers_are_400s(client):
    # Python's json (what the server parses with) accepts NaN and Infinity literals
    raw = b'{"model": "fake-model", "prompt": "hi", "max_tokens": 2, "logit_bias": {"5": NaN}}'
    r = client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias", r.text
    raw = b'{"text": "hi", "sampling_params": {"temperature": Infinity}}'
    r = client.post("/generate", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "sampling_params.temperature", r.text


def test_a_huge_integer_sampling_value_is_a_float_or_a_400_never_a_500(client, tm):
    """Fuzz audit 31: temperature 2**70 on /generate reached the scheduler as a Python int and failed to
    serialise there (a 500 with a traceback)."""
    r = client.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2, "temperature": 2**70,
                                                                          "repetition_penalty": 2**70}})
    assert r.status_code == 200, r.text
    sp = tm.inputs[-1].sampling_params
    assert type(sp.temperature) is float and type(sp.repetition_penalty) is float
    raw = b'{"text": "hi", "sampling_params": {"temperature": 1' + b"0" * 400 + b"}}"
    r = client.post("/generate", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "sampling_params.temperature", r.text
    assert "an integer of about 401 digits" in r.json()["error"]["message"]


def test_ids_inside_the_vocabulary_still_work(tm, client):
    body = {"model": MODEL, "prompt": [0, 199], "max_tokens": 2, "logit_bias": {"199": -100}, "stop_token_ids": [0]}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    assert tm.inputs[-1].sampling_params.logit_bias == {199: -100.0}
    r = client.post("/generate", json={"input_ids": [199], "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 200, r.text


def test_tokenize_gives_the_ids_generation_uses(tm, client):
    r = client.post("/tokenize", json={"model": MODEL, "prompt": "abc", "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == tm.tokenizer.encode("abc") and body["count"] == 3 and body["max_model_len"] == 64
    assert len(body["token_strs"]) == 3
    # chat messages: rendered exactly as /v1/chat/completions renders them for the runtime
    chat = client.post("/tokenize", json={"messages": CHAT}).json()
    assert chat["token_strs"] is None
    assert client.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT, "max_tokens": 1}).status_code == 200
    assert chat["tokens"] == tm.inputs[-1].input_ids
    back = client.post("/detokenize", json={"tokens": body["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": tm.tokenizer.decode(body["tokens"])}


@pytest.mark.parametrize(("route", "body", "status", "param"), [
    ("/tokenize", {"prompt": "a", "messages": CHAT}, 400, "prompt"),
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"messages": CHAT, "add_special_tokens": True}, 400, "add_special_tokens"),
    ("/tokenize", {"model": "other", "prompt": "a"}, 404, "model"),
    # fuzz audit 31: a 500 with pydantic's text; the chat route's own 400
    ("/tokenize", {"messages": [{"role": "tool", "content": "x", "tool_call_id": "a"}]}, 400, "messages.0"),
    ("/detokenize", {"tokens": [VOCAB]}, 400, "tokens"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
])
def test_tokenize_routes_refuse_bad_input_by_name(client, route, body, status, param):
    r = client.post(route, json=body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_tokenizer_info_for_remote_tokenizer_clients(client):
    info = client.get("/tokenizer_info").json()
    assert info["model_max_length"] == 64
    assert {"bos_token", "eos_token", "pad_token", "chat_template", "tokenizer_class"} <= set(info)


def test_sglang_info_routes(tm, client):
    info = client.get("/get_model_info").json()
    assert info["is_generation"] is True and info["served_model_name"] == MODEL and info["max_model_len"] == 64
    assert client.get("/get_server_info").json()["model_name"] == MODEL


def test_server_info_shows_the_resolved_stack_the_scheduler_reported(tm):
    """Plugin-author audit 37, G1: /server_info had only the configuration as given; the scheduler's start-up
    report of the components it runs (names, distributions, options) is shown as `resolved_stack`."""
    stack = {"policy": {"name": "lpm", "distribution": "radixserve-policies", "version": "0.1.0",
                        "options": {"fcfs_threshold": 5}}, "drafter": None}
    tm.server_info = {"context_len": tm.context_len, "resolved_stack": stack}
    assert make_client(tm).get("/server_info").json()["resolved_stack"] == stack
    del tm.server_info  # a front end that heard nothing (yet) says null
    assert make_client(tm).get("/server_info").json()["resolved_stack"] is None
