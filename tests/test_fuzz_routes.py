"""Property-based fuzz of every route of the HTTP layer (hypothesis strategies of our own): valid
and invalid JSON bodies never give a 5xx, and the server stays healthy. Runs against the fake
runtime of test_http_api (the layer that validates); RADIXSERVE_FUZZ_EXAMPLES sets the count.

RADIXSERVE_FUZZ_URL=http://host:port points the same fuzz at a running server on a real model
(RADIXSERVE_FUZZ_API_KEY if it has one); it then also checks that no KV slot leaked: after
/flush_cache, /server_info reports every token slot free."""

from __future__ import annotations

import collections
import json
import os

import httpx
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from radixserve.config import Config
from radixserve.server.app import create_app
from test_http_api import CHAT, MODEL, VOCAB, FakeTM

EXAMPLES = int(os.environ.get("RADIXSERVE_FUZZ_EXAMPLES", "300"))
REAL_SERVER = os.environ.get("RADIXSERVE_FUZZ_URL")

token_id = st.one_of(st.integers(-5, VOCAB + 5), st.integers(-(1 << 70), 1 << 70))
ids = st.lists(token_id, min_size=0, max_size=8)
number = st.one_of(st.integers(-(1 << 66), 1 << 66), st.floats(allow_nan=True, allow_infinity=True))
junk = st.one_of(st.none(), st.booleans(), number, st.text(max_size=8), st.lists(st.integers(-3, 3), max_size=3))
sampling_values = {
    "max_tokens": st.one_of(st.integers(-2, 80), junk),
    "temperature": st.one_of(st.floats(-1, 3), junk),
    "top_p": st.one_of(st.floats(-0.5, 1.5), junk),
    "top_k": st.one_of(st.integers(-3, 50), junk),
    "n": st.one_of(st.integers(0, 3), junk),
    "seed": st.one_of(st.integers(-(1 << 70), 1 << 70), junk),
    "stop": st.one_of(st.text(max_size=3), st.lists(st.text(max_size=3), max_size=3), junk),
    "stop_token_ids": st.one_of(ids, junk),
    "logit_bias": st.one_of(
        st.dictionaries(st.one_of(st.text(max_size=4), token_id.map(str)), number, max_size=3), junk
    ),
    "stream": st.booleans(),
    "logprobs": st.one_of(st.booleans(), st.integers(-1, 25), junk),
    "min_tokens": st.one_of(st.integers(-1, 5), junk),
    "echo": st.booleans(),
    "prompt_logprobs": st.one_of(st.integers(-2, 22), junk),  # vLLM's field
}
openai_fields = st.fixed_dictionaries({"model": st.one_of(st.just(MODEL), junk)}, optional=sampling_values)
completions = st.tuples(
    st.just("/v1/completions"),
    openai_fields.flatmap(
        lambda d: st.one_of(st.text(max_size=20), ids, st.lists(ids, max_size=3), junk).map(
            lambda pr: {**d, "prompt": pr}
        )
    ),
)
chat = st.tuples(
    st.just("/v1/chat/completions"),
    openai_fields.flatmap(
        lambda d: st.one_of(
            st.just(CHAT),
            st.lists(
                st.fixed_dictionaries(
                    {
                        "role": st.sampled_from(["user", "system", "tool", "x"]),
                        "content": st.one_of(st.text(max_size=5), junk),
                    }
                ),
                max_size=2,
            ),
            junk,
        ).map(lambda m: {**d, "messages": m})
    ),
)
native_sampling = st.fixed_dictionaries(
    {},
    optional={
        "max_new_tokens": st.one_of(st.integers(-2, 80), junk),
        "temperature": st.one_of(st.floats(-1, 3), junk),
        "logit_bias": st.one_of(st.dictionaries(token_id.map(str), number, max_size=2), junk),
        "stop_token_ids": st.one_of(ids, junk),
        "stop": st.one_of(st.text(max_size=3), st.lists(st.one_of(st.text(max_size=3), junk), max_size=2), junk),
        "seed": st.one_of(st.integers(-(1 << 70), 1 << 70), junk),
        "top_k": st.one_of(st.integers(-3, 50), junk),
        "prompt_logprobs": st.one_of(st.integers(-2, 22), junk),
        "bogus": junk,
    },
)
generate = st.tuples(
    st.just("/generate"),
    st.fixed_dictionaries(
        {},
        optional={
            "text": st.one_of(st.text(max_size=20), junk),
            "input_ids": st.one_of(ids, junk),
            "sampling_params": st.one_of(native_sampling, junk),
            "stream": st.booleans(),
            "return_logprob": st.one_of(st.booleans(), junk),
            "top_logprobs_num": st.one_of(st.integers(-1, 25), junk),
            "logprob_start_len": st.one_of(st.integers(-2, 10), junk),
        },
    ),
)
tokenizing = st.one_of(
    st.tuples(st.just("/tokenize"), st.fixed_dictionaries({}, optional={
        "model": st.one_of(st.just(MODEL), junk), "prompt": st.one_of(st.text(max_size=20), junk),
        "messages": st.one_of(st.just(CHAT), junk), "add_special_tokens": st.one_of(st.booleans(), junk),
        "return_token_strs": st.one_of(st.booleans(), junk)})),
    st.tuples(st.just("/detokenize"), st.fixed_dictionaries({}, optional={
        "model": st.one_of(st.just(MODEL), junk), "tokens": st.one_of(ids, junk)})),
)
other = st.tuples(
    st.sampled_from(
        ["/v1/models", "/health", "/server_info", "/get_server_info", "/get_model_info", "/tokenizer_info", "/metrics", "/flush_cache",
         "/abort_request", "/v1/models/x", "/nope"]
    ),
    st.one_of(junk, st.just({"rid": "a"})),
)
requests = st.one_of(completions, chat, generate, tokenizing, other)


def _client():
    if REAL_SERVER:
        key = os.environ.get("RADIXSERVE_FUZZ_API_KEY")
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.Client(base_url=REAL_SERVER, headers=headers, timeout=600)
    return TestClient(create_app(FakeTM(), Config.build({})))


def _model_name(client) -> str:
    return client.get("/v1/models").json()["data"][0]["id"] if REAL_SERVER else MODEL


def test_no_route_answers_5xx_and_the_server_stays_healthy():
    client = _client()
    model = _model_name(client)
    statuses: collections.Counter = collections.Counter()

    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(requests)
    def one(req):
        route, body = req
        if isinstance(body, dict) and body.get("model") == MODEL:
            body = {**body, "model": model}
        if route in ("/v1/completions", "/v1/chat/completions", "/generate", "/abort_request", "/tokenize", "/detokenize"):
            # NaN / Infinity literals on purpose: Python's json, which the server parses with, accepts them
            r = client.post(route, content=json.dumps(body), headers={"content-type": "application/json"})
        else:
            r = client.get(route)
        statuses[r.status_code] += 1
        assert r.status_code < 500, (route, body, r.text)

    one()
    assert client.get("/health").status_code == 200
    print("fuzz statuses:", dict(statuses))
    if REAL_SERVER:  # nothing in flight now: every slot must be free once the prefix cache is dropped
        assert client.post("/flush_cache").status_code == 200
        stats = client.get("/server_info").json()["stats"]
        print("after flush:", {k: stats[k] for k in ("free_tokens", "max_total_tokens", "failed_requests")})
        assert stats["free_tokens"] == stats["max_total_tokens"], stats
