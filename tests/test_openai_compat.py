"""Request validation as OpenAI's API does it, found by an outside black-box test: lone surrogates,
assistant messages sent back from the openai client, null as the default, strict types, /generate
fields it would ignore, and the `param` / message of every 400. Runs against the fake runtime of
test_http_api (and a TokenizerManager with a fake scheduler for the runtime's refusals)."""

from __future__ import annotations

import asyncio
import json
import time

import openai
import pytest
from fastapi.testclient import TestClient
from radixserve.config import Config
from radixserve.messages import ReqTextOut
from radixserve.runtime.tokenizer_manager import GenerateInput, TokenizerManager
from radixserve.server.app import create_app
from radixserve.server.runtime_api import RequestError
from radixserve.state import SamplingParams
from radixserve.validation import InvalidRequest, ModelLimits, validate_request
from test_http_api import CHAT, MODEL, FakeTM, FakeTokenizer, make_client


@pytest.fixture
def tm() -> FakeTM:
    return FakeTM()


@pytest.fixture
def client(tm) -> TestClient:
    return make_client(tm)


def post(client: TestClient, route: str, body: dict):
    # json.dumps writes a lone surrogate as the escape "\ud800": valid JSON, as a client sends it
    return client.post(route, content=json.dumps(body), headers={"content-type": "application/json"})


def assert_400(r, param: str, words: str = "") -> dict:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error", err
    assert err["param"] == param, err
    assert words in err["message"], err
    return err


def chat(**kw) -> dict:
    return {"model": MODEL, "messages": CHAT, "max_tokens": 2, **kw}


def completion(**kw) -> dict:
    return {"model": MODEL, "prompt": "hi", "max_tokens": 2, **kw}


S = "\ud800"  # a lone surrogate: valid JSON (as an escape), not valid Unicode text


# ---- 1. lone surrogates: a 400 naming the field, never a 500 -----------------------------------


@pytest.mark.parametrize(
    "route,body,param",
    [
        ("/v1/completions", completion(prompt=S), "prompt"),
        ("/v1/completions", completion(prompt=["ok", "a" + S]), "prompt.1"),
        ("/v1/completions", completion(stop=S), "stop"),
        ("/v1/completions", completion(stop=["x", S]), "stop.1"),
        ("/v1/chat/completions", chat(stop=S), "stop"),
        ("/v1/chat/completions", chat(messages=[{"role": "user", "content": S}]), "messages.0.content"),
        ("/v1/chat/completions", chat(user=S), "user"),
        ("/v1/chat/completions", chat(logit_bias={S: 1}), "logit_bias.\\ud800"),
        ("/generate", {"text": S}, "text"),
        ("/generate", {"text": "hi", "sampling_params": {"stop": [S]}}, "sampling_params.stop.0"),
        ("/generate", {"text": "hi", "sampling_params": {"regex": "a" + S}}, "sampling_params.regex"),
        ("/abort_request", {"rid": S}, "rid"),
    ],
)
def test_lone_surrogates_are_a_400_naming_the_field(tm, client, route, body, param):
    for stream in (False, True) if route != "/abort_request" else (False,):
        r = post(client, route, {**body, "stream": stream} if route != "/abort_request" else body)
        assert_400(r, param, "lone UTF-16 surrogate")
    assert tm.inputs == [] and tm.aborted == []
    assert client.get("/health").status_code == 200


class RaisingTokenizer(FakeTokenizer):
    def encode(self, text: str) -> list[int]:
        text.encode("utf-8")  # fails on a lone surrogate, as the real (Rust) tokenizer does (TypeError)
        return super().encode(text)


def runtime_tm(error: str | None = None, status: int = 400) -> TokenizerManager:
    """A TokenizerManager without child processes: its "scheduler" answers every request with
    `error` (a refusal, as ReqTextOut.error, with HTTP `status`)."""
    tm = object.__new__(TokenizerManager)
    tm.tokenizer = RaisingTokenizer()
    tm.model_name, tm.context_len = MODEL, 64
    tm.server_info = {"vocab_size": 200, "context_len": 64}
    tm._rid_to_state, tm.dead_reason, tm._started, tm._closing, tm._stopping = {}, None, True, False, None

    class Scheduler:
        def encode(self, _msg) -> bytes:
            return b""

        async def send(self, _data) -> None:
            for st in tm._rid_to_state.values():
                st.queue.put_nowait(ReqTextOut(rid=st.rid, text_delta="", new_ids=[], error=error, error_status=status))

    tm._send = tm._enc = Scheduler()
    return tm


def test_the_runtime_refuses_lone_surrogates_by_name_too():
    """The Engine's callers reach the TokenizerManager without the HTTP models."""
    tm = runtime_tm()
    with pytest.raises(InvalidRequest) as e:
        tm._prepare(GenerateInput(text="a" + S))
    assert e.value.param == "text" and e.value.status == 400
    with pytest.raises(InvalidRequest) as e:
        validate_request([1], SamplingParams(max_new_tokens=2, stop=[S]), ModelLimits(200, 64))
    assert e.value.param == "sampling_params.stop"
    with pytest.raises(InvalidRequest) as e:
        validate_request([1], SamplingParams(max_new_tokens=2, ebnf=S), ModelLimits(200, 64))
    assert e.value.param == "sampling_params.ebnf"


# ---- 2. an assistant message as the openai client returns it ------------------------------------


def test_assistant_message_from_model_dump_is_accepted(client, tm):
    oai = openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=client, max_retries=0)
    answer = oai.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2).choices[0].message
    sent_back = answer.model_dump()  # role, content, refusal, annotations, audio, function_call, tool_calls
    history = [*CHAT, sent_back, {"role": "user", "content": "more"}]
    r = oai.chat.completions.create(model=MODEL, messages=history, max_tokens=2)
    assert r.choices[0].message.content
    explicit = {"role": "assistant", "content": "x", "refusal": None, "annotations": [], "audio": None,
                "function_call": None, "tool_calls": None}
    assert post(client, "/v1/chat/completions", chat(messages=[*CHAT, explicit])).status_code == 200
    refused = {"role": "assistant", "content": None, "refusal": "I can't help with that."}
    assert post(client, "/v1/chat/completions", chat(messages=[*CHAT, refused, CHAT[1]])).status_code == 200
    bad = [{"role": "user", "content": "x", "refusal": "no"}]
    assert_400(post(client, "/v1/chat/completions", chat(messages=bad)), "messages.0.refusal")


# ---- 3. null means the default ------------------------------------------------------------------

CHAT_NULLABLE = [
    "n", "logprobs", "stream", "presence_penalty", "frequency_penalty", "max_tokens", "max_completion_tokens",
    "temperature", "top_p", "seed", "stop", "user", "top_logprobs", "logit_bias", "stream_options",
    "response_format", "tools", "tool_choice", "parallel_tool_calls", "store", "metadata", "top_k", "min_p",
    "min_tokens", "repetition_penalty", "ignore_eos", "stop_token_ids", "skip_special_tokens", "rid",
    "priority", "separate_reasoning", "chat_template_kwargs", "add_generation_prompt",
]
COMPLETION_NULLABLE = [
    "n", "logprobs", "stream", "presence_penalty", "frequency_penalty", "max_tokens", "echo", "temperature",
    "top_p", "seed", "stop", "user", "logit_bias", "stream_options", "suffix", "best_of", "min_tokens",
]


def _params(tm: FakeTM) -> SamplingParams:
    return tm.inputs[-1].sampling_params


@pytest.mark.parametrize("field", CHAT_NULLABLE)
def test_null_means_the_default_on_chat(client, tm, field):
    body = {"model": MODEL, "messages": CHAT}
    assert post(client, "/v1/chat/completions", body).status_code == 200
    default = _params(tm)
    r = post(client, "/v1/chat/completions", {**body, field: None})
    assert r.status_code == 200, r.text
    assert _params(tm) == default


@pytest.mark.parametrize("field", COMPLETION_NULLABLE)
def test_null_means_the_default_on_completions(client, tm, field):
    body = {"model": MODEL, "prompt": "hi"}
    assert post(client, "/v1/completions", body).status_code == 200
    default = _params(tm)
    r = post(client, "/v1/completions", {**body, field: None})
    assert r.status_code == 200, r.text
    assert _params(tm) == default and default.max_new_tokens == 16
    assert r.json()["choices"][0]["text"] == post(client, "/v1/completions", body).json()["choices"][0]["text"]


def test_null_means_the_default_on_generate(client, tm):
    r = post(client, "/generate", {"text": "hi", "stream": None, "rid": None, "return_logprob": None,
                                   "sampling_params": {"max_new_tokens": 2, "stop": None, "seed": None,
                                                       "temperature": None, "n": None}})
    assert r.status_code == 200, r.text
    assert _params(tm) == SamplingParams(max_new_tokens=2)


# ---- 4. strict types, and fields that need others -----------------------------------------------


@pytest.mark.parametrize(
    "route,body,param",
    [
        ("/v1/completions", completion(max_tokens="5"), "max_tokens"),
        ("/v1/completions", completion(max_tokens=True), "max_tokens"),
        ("/v1/chat/completions", chat(max_tokens="5"), "max_tokens"),
        ("/v1/chat/completions", chat(n=True), "n"),
        ("/v1/chat/completions", chat(logprobs="yes"), "logprobs"),
        ("/v1/chat/completions", chat(temperature="1"), "temperature"),
        ("/v1/chat/completions", chat(temperature=True), "temperature"),
        ("/v1/chat/completions", chat(stream="true"), "stream"),
        ("/v1/chat/completions", chat(parallel_tool_calls="no"), "parallel_tool_calls"),
        ("/v1/chat/completions", chat(tools=[{"type": "function", "function": {"name": "f", "strict": "true"}}]),
         "tools.0.function.strict"),
        ("/v1/completions", completion(echo="yes"), "echo"),
        ("/v1/completions", completion(logprobs=True), "logprobs"),
        ("/v1/completions", completion(prompt=[True]), "prompt"),
        ("/v1/completions", completion(prompt=[[5, True]]), "prompt"),
        ("/v1/completions", completion(stop_token_ids=[True]), "stop_token_ids.0"),
        ("/generate", {"input_ids": [1, True]}, "input_ids.1"),
        ("/generate", {"text": "hi", "return_logprob": "yes"}, "return_logprob"),
        # a message needs content (only an assistant message that made calls may leave it out)
        ("/v1/chat/completions", chat(messages=[{"role": "user"}]), "messages.0.content"),
        ("/v1/chat/completions", chat(messages=[{"role": "user", "content": None}]), "messages.0.content"),
        ("/v1/chat/completions", chat(messages=[{"role": "user", "content": []}]), "messages.0.content"),
        ("/v1/chat/completions", chat(messages=[*CHAT, {"role": "assistant"}]), "messages.2.content"),
        ("/v1/chat/completions", chat(stream_options={"include_usage": True}), "stream_options"),
        ("/v1/completions", completion(stream=False, stream_options={"include_usage": True}), "stream_options"),
    ],
)
def test_loose_values_are_400s(client, tm, route, body, param):
    assert_400(post(client, route, body), param)
    assert tm.inputs == []


def test_ints_are_fine_floats_and_calls_need_no_content(client, tm):
    assert post(client, "/v1/chat/completions", chat(temperature=1, top_p=1, presence_penalty=0)).status_code == 200
    assert _params(tm).temperature == 1.0
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    history = [*CHAT, {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "c1", "content": "42"}]
    assert post(client, "/v1/chat/completions", chat(messages=history)).status_code == 200
    assert post(client, "/v1/chat/completions", chat(messages=[{"role": "user", "content": ""}])).status_code == 200


@pytest.mark.parametrize(
    "route,body,param,message",
    [
        ("/v1/chat/completions", chat(min_tokens=10, max_tokens=4), "min_tokens", "min_tokens (10) must not exceed max_tokens (4)"),
        ("/v1/chat/completions", chat(min_tokens=3, max_tokens=None, max_completion_tokens=2), "min_tokens",
         "min_tokens (3) must not exceed max_completion_tokens (2)"),
        ("/v1/completions", completion(min_tokens=10, max_tokens=4), "min_tokens", "min_tokens (10) must not exceed max_tokens (4)"),
        ("/generate", {"text": "hi", "sampling_params": {"min_new_tokens": 10, "max_new_tokens": 4}},
         "sampling_params.min_new_tokens",
         "sampling_params.min_new_tokens (10) must not exceed sampling_params.max_new_tokens (4)"),
    ],
)
def test_min_tokens_above_max_tokens_is_one_rule_everywhere(client, tm, route, body, param, message):
    err = assert_400(post(client, route, body), param)
    assert err["message"] == message
    assert tm.inputs == []


@pytest.mark.parametrize(
    "route,body,param,words",
    [
        # a negative max_new_tokens was reported as min_new_tokens (0) exceeding it: a field never sent
        ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": -1}}, "sampling_params.max_new_tokens",
         "sampling_params.max_new_tokens must be an integer >= 0, got -1"),
        ("/generate", {"text": "hi", "sampling_params": {"min_new_tokens": -2}}, "sampling_params.min_new_tokens",
         ">= 0, got -2"),
        # NaN on the OpenAI routes was reported against the range ("less than or equal to 2")
        ("/v1/chat/completions", chat(temperature=float("nan")), "temperature", "finite number"),
        ("/v1/completions", completion(repetition_penalty=float("nan")), "repetition_penalty", "finite number"),
        ("/v1/completions", completion(top_p=float("inf")), "top_p", "finite number"),
    ],
)
def test_the_error_names_the_value_that_is_wrong(client, tm, route, body, param, words):
    assert_400(post(client, route, body), param, words)
    assert tm.inputs == []


def test_a_body_that_is_not_json_says_where_it_breaks(client, tm):
    r = client.post("/v1/completions", content=b'{"model": "m", "prompt": "unterminated',
                    headers={"content-type": "application/json"})
    err = assert_400(r, None)
    assert err["message"] == "request body is not valid JSON: Unterminated string starting at character 25", err
    assert tm.inputs == []


def test_min_tokens_beyond_the_context_is_refused_not_cut(client, tm):
    # no max_tokens: the budget is what the context leaves (64 here); min_tokens used to be cut to it
    body = {k: v for k, v in chat(min_tokens=1000).items() if k not in ("max_tokens", "max_completion_tokens")}
    err = assert_400(post(client, "/v1/chat/completions", body), "min_tokens")
    assert "min_tokens (1000) must not exceed" in err["message"]


# ---- 5. /generate fields it would ignore ---------------------------------------------------------


@pytest.mark.parametrize(
    "body,param,words",
    [
        ({"sampling_params": {"n": 129}}, "sampling_params.n", "must be an integer in [1, 128], got 129"),
        ({"sampling_params": {"top_logprobs": 3}}, "sampling_params.top_logprobs", "requires sampling_params.logprobs"),
        ({"top_logprobs_num": 3}, "top_logprobs_num", "requires return_logprob=true"),
    ],
)
def test_generate_refuses_what_it_would_ignore(client, tm, body, param, words):
    assert_400(post(client, "/generate", {"text": "hi", **body}), param, words)
    ok = {"text": "hi", "return_logprob": True, "top_logprobs_num": 2, "sampling_params": {"n": 1, "max_new_tokens": 2}}
    assert post(client, "/generate", ok).status_code == 200


# ---- 6. `param` and message of request-level checks ---------------------------------------------


@pytest.mark.parametrize(
    "route,body,param,message",
    [
        ("/v1/chat/completions", chat(stop=["a", ""]), "stop",
         "stop: an empty string cannot be a stop string (a stop of \"\" alone means none)"),
        ("/v1/chat/completions", chat(stop=["x"] * 17), "stop", "stop: at most 16 stop strings, got 17"),
        ("/v1/chat/completions", chat(stop=5), "stop", "stop: Input should be a valid string or a valid list"),
        ("/v1/chat/completions", chat(messages=[{"role": "user", "content": 5}]), "messages.0.content",
         "messages.0.content: Input should be a valid string or a valid list"),
        ("/v1/chat/completions", chat(top_logprobs=2), "top_logprobs", "top_logprobs: requires logprobs=true"),
        ("/v1/chat/completions", chat(response_format={"type": "json_schema"}), "response_format.json_schema",
         'response_format.json_schema: required when type is "json_schema"'),
        ("/v1/completions", completion(prompt=[]), "prompt", "prompt: must not be empty"),
        ("/v1/completions", completion(prompt=[[1], []]), "prompt[1]", "prompt[1]: a token list must not be empty"),
        ("/v1/completions", completion(prompt=""), "prompt", "prompt: the prompt is empty"),
        ("/v1/completions", completion(best_of=3), "best_of", "best_of other than n is not supported"),
        ("/generate", {"text": "hi", "input_ids": [1]}, "text", "text: give exactly one of text or input_ids"),
        ("/generate", {}, "text", "text: give exactly one of text or input_ids"),
        ("/generate", {"input_ids": []}, "input_ids", "input_ids: must not be empty"),
    ],
)
def test_request_level_checks_name_their_field(client, route, body, param, message):
    err = assert_400(post(client, route, body), param)
    assert err["message"] == message


def test_a_constraint_that_does_not_compile_names_its_field():
    """The runtime's grammar compiler refuses it (scheduler/grammar.py: "<kind>: invalid ...")."""
    tm = runtime_tm("regex: invalid regex: unbalanced parenthesis")
    client = TestClient(create_app(tm, Config()))
    for stream in (False, True):
        body = {"text": "hi", "stream": stream, "sampling_params": {"regex": "a(", "max_new_tokens": 2}}
        err = assert_400(post(client, "/generate", body), "sampling_params.regex", "invalid regex")
        # the message starts with the field, as structured-output.md (Errors) says (it said `regex: ...`)
        assert err["message"] == "sampling_params.regex: invalid regex: unbalanced parenthesis", err
    with pytest.raises(InvalidRequest) as e:  # the Engine's error: the same TokenizerManager
        asyncio.run(_drain(tm, GenerateInput(text="hi", sampling_params=SamplingParams(max_new_tokens=2, regex="a("))))
    assert e.value.message.startswith("sampling_params.regex: invalid regex") and e.value.param == "sampling_params.regex"
    tm = runtime_tm("the prompt cannot run")  # other refusals keep no param
    with pytest.raises(Exception) as e:
        asyncio.run(_drain(tm, GenerateInput(text="hi", sampling_params=SamplingParams(max_new_tokens=2))))
    assert not isinstance(e.value, InvalidRequest) and e.value.message == "the prompt cannot run"


async def _drain(tm: TokenizerManager, inp: GenerateInput) -> None:
    async for _ in tm.generate(inp):
        pass


def test_chat_response_format_refused_by_the_runtime_names_response_format(client, tm):
    tm.reject = InvalidRequest("json_schema: invalid JSON schema: unsupported keyword", "sampling_params.json_schema")
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    for stream in (False, True):
        assert_400(post(client, "/v1/chat/completions", chat(response_format=fmt, stream=stream)),
                   "response_format", "invalid JSON schema")


@pytest.mark.parametrize("refusal", [
    "json_schema: invalid JSON schema: uniqueItems (at /uniqueItems) is not supported by the xgrammar backend",
    "json_schema: structured output needs a grammar backend and this server has none",
    "json_schema: the grammar backend 'toy' is unavailable: toy init exploded",
])
def test_completions_response_format_refused_by_the_runtime_names_response_format(refusal):
    """An outside audit: /v1/completions named `sampling_params.json_schema`, a field the client never
    sent, where chat names `response_format`."""
    client = TestClient(create_app(runtime_tm(refusal), Config()))  # through the real runtime's mapping
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "array", "uniqueItems": True}}}
    for stream in (False, True):
        err = assert_400(post(client, "/v1/completions", completion(response_format=fmt, stream=stream)),
                         "response_format")
        assert err["message"] == "response_format: " + refusal.split(": ", 1)[1], err


def test_a_grammar_backend_failure_is_a_500_for_that_request():
    """A backend whose compile broke its contract: the server's fault, not a 400 blaming the input."""
    failure = "regex: the grammar backend 'toy' failed while compiling this constraint: ValueError('bug')"
    fmt = {"type": "json_object"}
    tm = FakeTM()  # it has a chat template
    tm.reject = RequestError(failure, 500)
    runtime = TestClient(create_app(runtime_tm(failure, 500), Config()))
    for client, route, body in (
        (runtime, "/generate", {"text": "hi", "sampling_params": {"regex": "a+", "max_new_tokens": 2}}),
        (runtime, "/v1/completions", completion(response_format=fmt)),
        (make_client(tm), "/v1/chat/completions", chat(response_format=fmt)),
    ):
        for stream in (False, True):
            r = post(client, route, {**body, "stream": stream})
            err = r.json()["error"]
            assert r.status_code == 500 and err["type"] == "internal_server_error" and err["param"] is None, r.text
            assert "failed while compiling" in err["message"]


# ---- 7. an empty stop is no stop -----------------------------------------------------------------


@pytest.mark.parametrize(
    "route,body",
    [
        ("/v1/chat/completions", chat(stop="")),
        ("/v1/chat/completions", chat(stop=[])),
        ("/v1/completions", completion(stop="")),
        ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 2, "stop": ""}}),
    ],
)
def test_an_empty_stop_is_no_stop(client, tm, route, body):
    r = post(client, route, body)
    assert r.status_code == 200, r.text
    assert _params(tm).stop == []


# ---- 6. from session 26's outside client audit ---------------------------------------------------


def test_a_list_holding_one_id_list_names_the_entry(client, tm):
    err = assert_400(post(client, "/v1/completions", completion(prompt=[[1, -5]])), "prompt[0]")
    assert err["message"].startswith("prompt[0][1] token id -5"), err
    assert_400(post(client, "/v1/completions", completion(prompt=[1, -5])), "prompt", "prompt[1] token id -5")


def test_a_body_sent_as_another_content_type_names_the_header(client, tm):
    r = client.post("/v1/chat/completions", content=json.dumps(chat()), headers={"content-type": "text/plain"})
    err = assert_400(r, None)
    assert err["message"] == "Content-Type 'text/plain' is not JSON: send the body with Content-Type: application/json"
    r = client.post("/v1/chat/completions", content=json.dumps(chat()))
    if r.status_code != 200:  # FastAPI since 0.12x reads no body without a JSON Content-Type (older ones did)
        assert assert_400(r, None)["message"].startswith("the request has no Content-Type: send the body with")
    assert post(client, "/v1/chat/completions", chat()).status_code == 200


@pytest.mark.parametrize("body,words", [
    (b'{"model": "m", "prompt": "\xff\xfe"}', "not UTF-8 (byte 0xff at position 26)"),
    (b"[" * 100_000, "nested too deeply"),
])
def test_a_body_that_cannot_be_parsed_says_why(client, tm, body, words):
    err = assert_400(client.post("/v1/completions", content=body, headers={"content-type": "application/json"}), None)
    assert err["message"] == f"request body is not valid JSON: it is {words}", err
    assert tm.inputs == []


def test_max_tokens_and_max_completion_tokens_must_agree(client, tm):
    err = assert_400(post(client, "/v1/chat/completions", chat(max_tokens=7, max_completion_tokens=5)), "max_tokens")
    assert err["message"].startswith("max_tokens (7) differs from max_completion_tokens (5)"), err
    assert post(client, "/v1/chat/completions", chat(max_tokens=3, max_completion_tokens=3)).status_code == 200
    assert _params(tm).max_new_tokens == 3


def test_a_tool_result_without_its_call_is_a_400_and_empty_tools_are_none(client, tm):
    assert post(client, "/v1/chat/completions", chat(tools=[])).status_code == 200  # as vLLM and SGLang take it
    tm.inputs.clear()
    orphan = [{"role": "user", "content": "hi"}, {"role": "tool", "tool_call_id": "x", "content": "y"}]
    assert_400(post(client, "/v1/chat/completions", chat(messages=orphan)), "messages.1", "must follow an assistant")
    assert tm.inputs == []


def test_the_model_card_keeps_its_created_time(client):
    first = client.get("/v1/models").json()["data"][0]["created"]
    time.sleep(1.1)
    assert client.get("/v1/models").json()["data"][0]["created"] == first
    assert client.get(f"/v1/models/{MODEL}").json()["created"] == first


def test_completion_top_logprobs_hold_the_chosen_token_as_openai_and_vllm(client, tm):
    r = post(client, "/v1/completions", completion(logprobs=0, max_tokens=3))
    lp = r.json()["choices"][0]["logprobs"]
    assert [list(top) for top in lp["top_logprobs"]] == [[t] for t in lp["tokens"]], lp
    assert [list(top.values()) for top in lp["top_logprobs"]] == [[v] for v in lp["token_logprobs"]]


@pytest.mark.parametrize("field,words", [
    ("guided_json", 'response_format {"type": "json_schema"'),
    ("guided_regex", "sampling_params.regex"),
    ("regex", "sampling_params.regex"),
    ("request_id", "/generate's rid"),
    ("spaces_between_special_tokens", "has no equivalent here"),
    ("allowed_token_ids", "has no equivalent here"),
])
def test_a_vllm_or_sglang_field_is_refused_with_its_spelling_here(client, tm, field, words):
    err = assert_400(post(client, "/v1/completions", completion(**{field: "x"})), field)
    assert err["message"].startswith(f"{field}: Extra inputs are not permitted (vLLM's / SGLang's {field} "), err
    assert words in err["message"]
    assert tm.inputs == []


@pytest.mark.parametrize("route,body", [("/v1/completions", completion()), ("/v1/chat/completions", chat())])
def test_include_stop_str_in_output_is_sglangs_no_stop_trim(client, tm, route, body):
    """vLLM's field (refused until session 36) reaches the scheduler as SamplingParams.no_stop_trim."""
    assert post(client, route, {**body, "stop": ["x"]}).status_code == 200
    assert _params(tm).no_stop_trim is False
    r = post(client, route, {**body, "stop": ["x"], "include_stop_str_in_output": True})
    assert r.status_code == 200, r.text
    assert _params(tm).no_stop_trim is True and _params(tm).stop == ["x"]


@pytest.mark.parametrize("body,param", [({"text": ["a", "b"], "rid": ["x"]}, "rid"),
                                        ({"input_ids": [[5, 6], [7]], "sampling_params": [{}]}, "sampling_params")])
def test_generate_says_a_per_prompt_list_of_another_length_is_refused(client, tm, body, param):
    """Audit 34: SGLang's batch form got pydantic's "Input should be a valid string"; it is taken now, and a
    per-prompt list that does not match it is a 400 saying so."""
    err = assert_400(post(client, "/generate", body), param)
    assert err["message"] == f"{param}: a list of 1 for 2 prompts: give one for all prompts" + (
        " (an object)" if param == "sampling_params" else "") + ", or a list of one per prompt", err
    assert tm.inputs == []


def test_one_request_holds_at_most_1024_completions(client, tm):
    """Fuzz audit 31: 10,000 prompts in one 60 KB body held the server a minute ahead of everyone else."""
    err = assert_400(post(client, "/v1/completions", completion(prompt=["hi"] * 513, n=2)), "prompt")
    assert "at most 1024 completions in one request" in err["message"] and "513 x 2" in err["message"]
    assert tm.inputs == []
    r = post(client, "/v1/completions", completion(prompt=[[5, 6]] * 4, n=2))
    assert r.status_code == 200 and len(r.json()["choices"]) == 8, r.text


def test_openai_apis_this_server_lacks_say_so_and_version_is_vllms_route(client):
    """Migration audit 31: through the SDKs a bare "Not Found" read like a wrong model name."""
    r = post(client, "/v1/embeddings", {"model": MODEL, "input": "hello"})
    err = r.json()["error"]
    assert r.status_code == 404 and err["type"] == "not_found_error", r.text
    assert "this server has no" in err["message"] and "/v1/chat/completions" in err["message"]
    from radixserve.version import __version__

    assert client.get("/version").json() == {"version": __version__}
    assert client.get("/v1/models/foo").json()["error"]["message"].endswith(f"this server serves {MODEL!r}")


def test_the_model_may_be_left_out_as_vllm_and_sglang_allow(client, tm):
    body = {k: v for k, v in chat().items() if k != "model"}
    r = post(client, "/v1/chat/completions", body)
    assert r.status_code == 200 and r.json()["model"] == MODEL, r.text
    body = {k: v for k, v in completion().items() if k != "model"}
    assert post(client, "/v1/completions", body).json()["model"] == MODEL
    r = post(client, "/v1/completions", completion(model="other"))
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


# ---- 8. from session 29's outside client audit ---------------------------------------------------


def _too_long(r, param: str, words: str) -> None:
    err = assert_400(r, param, words)
    assert err["code"] == "context_length_exceeded", err  # OpenAI's code: client frameworks test for it
    assert err["message"].startswith("the prompt"), err


@pytest.mark.parametrize("stream", [False, True])
def test_context_length_errors_name_the_prompt_or_max_tokens_with_openais_code(client, tm, stream):
    """The prompt alone too long names the prompt's field; a prompt that fits but leaves too little
    room for max_tokens names max_tokens (the context is 64 tokens here)."""
    long_chat = [{"role": "user", "content": "x" * 80}]
    _too_long(post(client, "/v1/chat/completions", chat(messages=long_chat, max_tokens=None, stream=stream)),
              "messages", "the model's context length is 64 tokens")
    _too_long(post(client, "/v1/chat/completions", chat(max_tokens=60, stream=stream)), "max_tokens", "plus max_tokens (60)")
    _too_long(post(client, "/v1/chat/completions", chat(max_tokens=None, max_completion_tokens=60, stream=stream)),
              "max_completion_tokens", "plus max_completion_tokens (60)")
    _too_long(post(client, "/v1/completions", completion(prompt="x" * 70, stream=stream)), "prompt", "has 70 tokens")
    _too_long(post(client, "/v1/completions", completion(prompt=["hi", "x" * 70], stream=stream)), "prompt[1]",
              "has 70 tokens")
    _too_long(post(client, "/v1/completions", completion(prompt="x" * 50, max_tokens=16, stream=stream)),
              "max_tokens", "plus max_tokens (16)")
    _too_long(post(client, "/generate", {"input_ids": [1] * 70, "stream": stream}), "input_ids", "has 70 tokens")
    assert tm.inputs == []
    # a /generate text prompt is tokenized by the runtime: named `text`, as the client sent it (not input_ids)
    runtime = TestClient(create_app(runtime_tm(), Config()))
    _too_long(post(runtime, "/generate", {"text": "x" * 70, "stream": stream}), "text", "has 70 tokens")
    _too_long(post(runtime, "/generate", {"text": "x" * 50, "stream": stream, "sampling_params": {"max_new_tokens": 20}}),
              "sampling_params.max_new_tokens", "plus sampling_params.max_new_tokens (20)")


def test_the_engines_prompt_errors_name_its_own_argument():
    """Engine.generate(prompt=...) reported `text`, /generate's field, which the Engine does not have."""
    from radixserve.engine import Engine

    tm = runtime_tm()
    for prompt, words in (("", "prompt: the prompt is empty"), ("x" * 70, "the prompt has 70 tokens"),
                          ("a" + S, "prompt contains a lone UTF-16 surrogate")):
        [inp], _ = Engine._inputs(prompt, None, {"max_new_tokens": 2}, None, False, False, 0)
        with pytest.raises(InvalidRequest) as e:
            tm._prepare(inp)
        assert e.value.param == "prompt" and e.value.message.startswith(words), e.value.message
    [inp], _ = Engine._inputs(None, [1] * 70, {"max_new_tokens": 2}, None, False, False, 0)
    with pytest.raises(InvalidRequest) as e:
        tm._prepare(inp)
    assert e.value.param == "input_ids" and e.value.code == "context_length_exceeded"


def test_top_p_zero_is_accepted_as_openai_does_and_keeps_the_most_likely_token(client, tm):
    for route, body in (("/v1/chat/completions", chat(top_p=0, temperature=1)),
                        ("/v1/completions", completion(top_p=0.0)),
                        ("/generate", {"text": "hi", "sampling_params": {"top_p": 0, "max_new_tokens": 2}})):
        r = post(client, route, body)
        assert r.status_code == 200, r.text
        assert _params(tm).top_p == 0.0 and _params(tm).is_greedy
    for bad in (-0.1, 1.5):
        assert_400(post(client, "/v1/chat/completions", chat(top_p=bad)), "top_p")
        assert_400(post(client, "/generate", {"text": "hi", "sampling_params": {"top_p": bad}}), "sampling_params.top_p")


def test_an_unknown_model_is_openais_invalid_request_error_404(client):
    for r in (post(client, "/v1/chat/completions", chat(model="gpt-4o")), client.get("/v1/models/foo")):
        err = r.json()["error"]
        assert r.status_code == 404 and (err["type"], err["code"], err["param"]) == (
            "invalid_request_error", "model_not_found", "model"), err
    assert client.get("/v1/nothing").json()["error"]["type"] == "not_found_error"  # an unknown route keeps its type


@pytest.mark.parametrize("part", [
    {"type": "image_url", "image_url": {"url": "http://x/y.png"}},
    {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}},
    {"type": "file", "file": {"file_id": "f"}},
])
def test_a_content_part_that_is_not_text_is_one_clear_error(client, tm, part):
    """It was four pydantic errors about the union (a string? a text part? ...)."""
    messages = [{"role": "user", "content": [{"type": "text", "text": "look"}, part]}]
    err = assert_400(post(client, "/v1/chat/completions", chat(messages=messages)), "messages.0.content.1")
    assert err["message"] == f"messages.0.content.1: content part type {part['type']!r} is not supported (text only)"
    assert tm.inputs == []
