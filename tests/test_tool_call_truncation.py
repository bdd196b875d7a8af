"""A tool call cut off by max_tokens (finish_reason "length"): streamed and non-streamed responses
agree. Under `required` or a named function the output is the calls written so far (the last with
its incomplete arguments) and `content` is null; under `auto` a call whose name was complete is
returned the same way, text before it stays content, and a block cut before the name is content.
Through the parsers' assembler (`ChoiceOutput`) split at every position, and through the HTTP app
with the `openai` client and a canned runtime that ends by length."""

from __future__ import annotations

import json

import pytest
from fake_runtime import HealthyRuntime, openai_client
from radixserve.server.chat_output import ChoiceOutput
from radixserve.server.tool_parsers.constrained import NamedCallParser, RequiredCallsParser
from radixserve.server.tool_parsers.hermes import HermesToolParser
from radixserve.validation import ModelLimits

TOOLS = ["get_weather", "get_time"]

# (parser, output cut off by max_tokens, expected content, expected [(name, arguments)])
CUT = [
    ("named", '{"city":', None, [("get_time", '{"city":')]),
    ("named", '{"city": "Paris", "unit": "cel', None, [("get_time", '{"city": "Paris", "unit": "cel')]),
    ("named", "{", None, [("get_time", "{")]),
    ("required", '[{"name": "get_time", "arguments": {"ci', None, [("get_time", '{"ci')]),
    ("required", '[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {"tz',
     None, [("get_weather", '{"city": "Paris"}'), ("get_time", '{"tz')]),
    ("required", '[{"na', None, []),  # not even a name: no call, and never content
    ("auto", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par', "Let me check.",
     [("get_weather", '{"city": "Par')]),
    ("auto", '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_', None, [("get_time", "{}")]),
    ("auto", '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "get_weather", '
     '"arguments": {"ci', None, [("get_time", "{}"), ("get_weather", '{"ci')]),
    ("auto", 'Sure.\n<tool_call>\n{"na', 'Sure.\n<tool_call>\n{"na', []),  # cut before the name: content
    ("auto", "Just text, cut mid-sent", "Just text, cut mid-sent", []),
]


def _parser(kind: str):
    if kind == "named":
        return NamedCallParser(["get_time"])
    if kind == "required":
        return RequiredCallsParser(TOOLS)
    return HermesToolParser(TOOLS)


def _assemble(kind: str, text: str, step: int, truncated: bool = True) -> tuple[str | None, list[tuple[str, str]]]:
    """Stream `text` `step` characters at a time through the assembler and join the deltas as
    OpenAI's client does (content None when no content delta came)."""
    output = ChoiceOutput(None, _parser(kind))
    content, calls = None, {}
    cuts = list(range(step, len(text), step)) + [len(text)]
    for k in cuts:
        d = output.delta(text[:k], final=k == len(text), truncated=truncated)
        if d.content:
            content = (content or "") + d.content
        for c in d.calls:
            name, args = calls.get(c.index, ("", ""))
            calls[c.index] = (name + (c.name or ""), args + c.arguments)
    return content, [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("kind,text,content,calls", CUT, ids=[f"{c[0]}-{i}" for i, c in enumerate(CUT)])
def test_cut_off_calls_streamed_and_not_agree(kind, text, content, calls):
    whole = ChoiceOutput(None, _parser(kind)).finish(text, truncated=True)
    assert (whole.content, [(c.name, c.arguments) for c in whole.calls]) == (content, calls)
    for step in range(1, len(text) + 1):
        assert _assemble(kind, text, step) == (content, calls), step


def test_an_output_that_ended_otherwise_is_parsed_as_complete():
    """Only max_tokens makes an unfinished call a call: an output that stopped inside one (a stop
    string, EOS) is malformed, and its text is content."""
    text = 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'
    parts = ChoiceOutput(None, HermesToolParser(TOOLS)).finish(text)
    assert parts.content == text and parts.calls == []
    named = ChoiceOutput(None, NamedCallParser(["get_time"])).finish('{"city":')
    assert named.content == '{"city":' and named.calls == []


# ---- through the HTTP app -----------------------------------------------------------------------

MODEL = "canned"
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}
ASK = [{"role": "user", "content": "What time is it in Paris?"}]


class CutTM(HealthyRuntime):
    """A runtime whose model writes `reply`, `step` characters per streamed step, and ends by
    max_tokens (finish_reason length). One token per character; its chat template ignores tools."""

    def __init__(self, reply: str, step: int = 2) -> None:
        self.reply = reply
        self.step = step
        self.tokenizer = self
        self.chat_template = "{{ messages }}"
        self.model_name = MODEL
        self.context_len = 100_000

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i) for i in ids)

    @property
    def limits(self) -> ModelLimits:
        return ModelLimits(vocab_size=0x110000, context_len=self.context_len)

    def apply_chat_template(self, messages, add_generation_prompt=True, **kwargs):
        # ignores `tools`, as SmolLM2's template does: the server describes them (generic_tool_prompt)
        return self.encode(json.dumps(messages) + "<|assistant|>")

    async def generate(self, inp):
        cuts = list(range(self.step, len(self.reply), self.step)) + [len(self.reply)]
        for k in cuts:
            done = k == len(self.reply)
            if inp.stream or done:
                yield {"text": self.reply[:k], "output_ids": self.encode(self.reply[:k]), "meta_info": {
                    "id": inp.rid, "prompt_tokens": len(inp.input_ids), "completion_tokens": k, "cached_tokens": 0,
                    "finish_reason": {"type": "length"} if done else None}}


def _streamed(oai, **kw) -> tuple[str | None, list[tuple[str, str]], str | None]:
    content, calls, finish = None, {}, None
    for chunk in oai.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            if ch.delta.content:
                content = (content or "") + ch.delta.content
            for tc in ch.delta.tool_calls or []:
                name, args = calls.get(tc.index, ("", ""))
                calls[tc.index] = (name + (tc.function.name or ""), args + (tc.function.arguments or ""))
            finish = ch.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("tool_choice,reply,content,calls", [
    ({"type": "function", "function": {"name": "get_time"}}, '{"city":', None, [("get_time", '{"city":')]),
    ("required", '[{"name": "get_time", "arguments": {"city": "Pa', None, [("get_time", '{"city": "Pa')]),
    ("auto", 'I will look.\n<tool_call>\n{"name": "get_time", "arguments": {"city', "I will look.",
     [("get_time", '{"city')]),
    ("auto", 'I will look.\n<tool_call>\n{"nam', 'I will look.\n<tool_call>\n{"nam', []),
], ids=["named", "required", "auto", "auto-before-name"])
def test_truncated_call_streamed_and_not_through_the_openai_client(tool_choice, reply, content, calls, monkeypatch):
    from dataclasses import replace

    import radixserve.server.openai_serving as serving

    real = serving.check_sampling  # the canned runtime writes the constrained output itself
    monkeypatch.setattr(serving, "check_sampling", lambda sp, *a: real(replace(sp, json_schema=None), *a))
    oai = openai_client(CutTM(reply), generic_tool_prompt=True)
    kw = dict(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice=tool_choice, max_tokens=3)
    r = oai.chat.completions.create(**kw)
    msg, finish = r.choices[0].message, r.choices[0].finish_reason
    assert finish == "length"
    assert msg.content == content
    assert [(c.function.name, c.function.arguments) for c in msg.tool_calls or []] == calls
    assert all(c.id.startswith("call_") for c in msg.tool_calls or [])
    assert _streamed(oai, **kw) == (content, calls, "length")
