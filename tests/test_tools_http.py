"""Tool calling and reasoning on /v1/chat/completions through the real `openai` client, against the
server with a canned runtime: the "model" answers with a recorded output of each family's format,
streamed a few characters per step. Covers parsing (streamed and not), the template inputs
(tools, tool messages, earlier calls), tool_choice, and every 400."""

from __future__ import annotations

import json

import openai
import pytest
from fake_runtime import HealthyRuntime, openai_client
from radixserve.config import Config
from radixserve.interfaces import KINDS
from radixserve.plugins.registry import Registry
from radixserve.server.app import create_app
from radixserve.server.runtime_api import RequestError
from radixserve.validation import ModelLimits

MODEL = "canned"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}}}}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "Weather and time in Paris?"}]
PARIS = {"city": "Paris", "unit": "celsius"}

HERMES_OUT = ('I will check both.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
              '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}\n</tool_call>')
OUTPUTS = {  # recorded-style outputs of each format, with the calls they hold
    "hermes": HERMES_OUT,
    "llama3_json": '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; '
                   '{"name": "get_time", "parameters": {"tz": "Europe/Paris"}}',
    "mistral": '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
               '{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}]',
    "pythonic": '[get_weather(city="Paris", unit="celsius"), get_time(tz="Europe/Paris")]',
}
EXPECTED_CALLS = [("get_weather", PARIS), ("get_time", {"tz": "Europe/Paris"})]


class CharTokenizer:
    """One token per character (ids are code points), so prompts can be read back."""

    def __init__(self, chat_template: str | None) -> None:
        self.chat_template = chat_template

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i) for i in ids)


class CannedTM(HealthyRuntime):
    """A runtime whose model always answers `reply`, `step` characters per streamed step.
    Its chat template renders tools (unless `renders_tools` is False) and any message fields."""

    def __init__(self, reply: str = "", chat_template: str | None = None, renders_tools: bool = True,
                 generation_prompt: str = "<|assistant|>") -> None:
        self.tokenizer = CharTokenizer(chat_template)
        self.model_name = MODEL
        self.context_len = 100_000
        self.reply = reply
        self.step = 3
        self.renders_tools = renders_tools
        self.generation_prompt = generation_prompt
        self.has_grammar = HAS_GRAMMAR  # False: constrained requests are refused, as the runtime does
        self.inputs: list = []
        self.rendered: list[tuple[list[dict], dict]] = []

    @property
    def limits(self) -> ModelLimits:
        return ModelLimits(vocab_size=0x110000, context_len=self.context_len)

    def apply_chat_template(self, messages, add_generation_prompt=True, **kwargs):
        self.rendered.append((messages, kwargs))
        text = "".join(f"<|{m['role']}|>{json.dumps(m, sort_keys=True)}" for m in messages)
        if kwargs.get("tools") and self.renders_tools:
            text = f"<|tools|>{json.dumps(kwargs['tools'])}" + text
        return self.tokenizer.encode(text + (self.generation_prompt if add_generation_prompt else ""))

    async def generate(self, inp):
        self.inputs.append(inp)
        if inp.sampling_params.json_schema is not None and not self.has_grammar:  # as the scheduler answers
            raise RequestError("json_schema: structured output needs a grammar backend and this server has none", 400)
        cuts = list(range(self.step, len(self.reply), self.step)) + [len(self.reply)]
        for k in cuts:
            done = k == len(self.reply)
            out = {
                "text": self.reply[:k],
                "output_ids": self.tokenizer.encode(self.reply[:k]),
                "meta_info": {"id": inp.rid, "prompt_tokens": len(inp.input_ids), "completion_tokens": k,
                              "cached_tokens": 0, "finish_reason": {"type": "stop", "matched": 2} if done else None},
            }
            if inp.stream or done:
                yield out


def calls_of(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


def raw_stream(oai, **kw) -> tuple[list, dict]:
    """The chunks, and the message assembled the way OpenAI's client documents it."""
    chunks = list(oai.chat.completions.create(stream=True, **kw))
    msg = {"content": "", "reasoning_content": "", "calls": {}, "finish_reason": None}
    for chunk in chunks:
        for ch in chunk.choices:
            d = ch.delta
            msg["content"] += d.content or ""
            msg["reasoning_content"] += getattr(d, "reasoning_content", None) or ""
            for tc in d.tool_calls or []:
                slot = msg["calls"].setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                if tc.id:
                    slot["id"] = tc.id
                if tc.function and tc.function.name:
                    slot["name"] += tc.function.name
                if tc.function and tc.function.arguments:
                    slot["arguments"] += tc.function.arguments
            msg["finish_reason"] = ch.finish_reason or msg["finish_reason"]
    return chunks, msg


@pytest.mark.parametrize("parser", sorted(OUTPUTS))
def test_each_parser_non_streamed_and_streamed_through_the_openai_client(parser):
    tm = CannedTM(OUTPUTS[parser])
    oai = openai_client(tm, tool_call_parser=parser)
    r = oai.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS)
    msg = r.choices[0].message
    assert calls_of(msg) == EXPECTED_CALLS
    assert r.choices[0].finish_reason == "tool_calls"
    assert all(c.id.startswith("call_") and c.type == "function" for c in msg.tool_calls)
    assert msg.content == ("I will check both." if parser == "hermes" else None)
    special = parser in ("llama3_json", "mistral")  # markers are special tokens: kept in the text
    assert tm.inputs[-1].sampling_params.skip_special_tokens is (not special)

    chunks, streamed = raw_stream(oai, model=MODEL, messages=ASK, tools=TOOLS)
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed["calls"].values()] == EXPECTED_CALLS
    assert streamed["content"] == (msg.content or "") and streamed["finish_reason"] == "tool_calls"
    for marker in ("<tool_call>", "[TOOL_CALLS]", "<|python_tag|>", '"name"', "get_weather("):
        assert marker not in streamed["content"]
    # a call's first delta has id, type and name, with no arguments yet; fragments follow
    firsts = [tc for c in chunks for ch in c.choices for tc in ch.delta.tool_calls or [] if tc.id]
    assert [(tc.index, tc.type, tc.function.name, tc.function.arguments) for tc in firsts] == [
        (0, "function", "get_weather", ""), (1, "function", "get_time", "")]
    fragments = [tc for c in chunks for ch in c.choices for tc in ch.delta.tool_calls or [] if not tc.id]
    assert all(tc.function.name is None for tc in fragments)
    if parser != "pythonic":  # JSON arguments stream as the model writes them; pythonic per call
        assert len([f for f in fragments if f.index == 0]) > 1


def test_a_streamed_call_whose_arguments_stop_being_json_sends_only_their_valid_start():
    """Tools audit 30: `{"tz": C` went out as argument fragments although no JSON value starts that way."""
    from radixserve.server.tool_parsers.json_scan import json_prefix_length

    bad = 'Hi!\n<tool_call>\n{"name": "get_time", "arguments": {"tz": CET}}\n</tool_call>'
    tm = CannedTM(bad)
    tm.step = 1
    oai = openai_client(tm, tool_call_parser="hermes")
    chunks, streamed = raw_stream(oai, model=MODEL, messages=ASK, tools=TOOLS)
    for call in streamed["calls"].values():
        assert json_prefix_length(call["arguments"]) == len(call["arguments"]), call
        assert "C" not in call["arguments"]
    assert streamed["finish_reason"] == "stop" and "CET" in streamed["content"]


def test_the_openai_stream_helper_assembles_the_calls():
    oai = openai_client(CannedTM(HERMES_OUT), tool_call_parser="hermes")
    with oai.chat.completions.stream(model=MODEL, messages=ASK, tools=TOOLS) as stream:
        final = stream.get_final_completion()
    assert calls_of(final.choices[0].message) == EXPECTED_CALLS
    assert final.choices[0].message.content == "I will check both."
    assert final.choices[0].finish_reason == "tool_calls"


def test_parser_detected_from_the_chat_template():
    tm = CannedTM(HERMES_OUT, chat_template="{% for m in messages %}...<tool_call>\n{{ tool_call | tojson }}...")
    r = openai_client(tm).chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS)
    assert calls_of(r.choices[0].message) == EXPECTED_CALLS


def test_text_answer_with_tools_and_tool_choice_none():
    tm = CannedTM("It is sunny in Paris.")
    oai = openai_client(tm, tool_call_parser="hermes")
    r = oai.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS)
    assert r.choices[0].message.content == "It is sunny in Paris." and r.choices[0].message.tool_calls is None
    assert r.choices[0].finish_reason == "stop"
    assert tm.rendered[-1][1]["tools"] == TOOLS
    # none: the tools are not shown and the output is not parsed
    tm.reply = HERMES_OUT
    r = oai.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none")
    assert r.choices[0].message.content == HERMES_OUT and r.choices[0].message.tool_calls is None
    assert "tools" not in tm.rendered[-1][1]


def test_parallel_tool_calls_false_returns_one_call():
    oai = openai_client(CannedTM(HERMES_OUT), tool_call_parser="hermes")
    r = oai.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, parallel_tool_calls=False)
    assert calls_of(r.choices[0].message) == EXPECTED_CALLS[:1]
    _, streamed = raw_stream(oai, model=MODEL, messages=ASK, tools=TOOLS, parallel_tool_calls=False)
    assert list(streamed["calls"]) == [0]


def test_history_with_calls_and_results_goes_to_the_template():
    tm = CannedTM("It is 18 degrees and 15:00 in Paris.")
    oai = openai_client(tm, tool_call_parser="hermes")
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 18}'},
        {"role": "tool", "tool_call_id": "call_2", "content": "15:00"},
    ]
    r = oai.chat.completions.create(model=MODEL, messages=history, tools=TOOLS)
    assert r.choices[0].message.content == "It is 18 degrees and 15:00 in Paris."
    messages, kwargs = tm.rendered[-1]
    assert kwargs["tools"] == TOOLS
    assert messages[1]["tool_calls"][0] == {
        "id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    assert messages[2] == {"role": "tool", "content": '{"temp": 18}', "tool_call_id": "call_1", "name": "get_weather"}
    assert messages[3]["name"] == "get_time"


def test_template_without_tools_is_a_400_unless_the_generic_prompt_is_on():
    tm = CannedTM(HERMES_OUT, renders_tools=False)
    with pytest.raises(openai.BadRequestError) as e:
        openai_client(tm, tool_call_parser="hermes").chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS)
    assert e.value.body["param"] == "tools" and "does not render tools" in e.value.body["message"]
    assert "generic_tool_prompt" in e.value.body["message"]
    # generic prompt: the tools are described in a system message and parsed as Hermes blocks
    tm = CannedTM(HERMES_OUT, renders_tools=False)
    oai = openai_client(tm, generic_tool_prompt=True)
    history = ASK + [
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                              "function": {"name": "get_time", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "15:00"},
    ]
    r = oai.chat.completions.create(model=MODEL, messages=history, tools=TOOLS)
    assert calls_of(r.choices[0].message) == EXPECTED_CALLS
    messages, kwargs = tm.rendered[-1]
    assert "tools" not in kwargs and messages[0]["role"] == "system"
    assert '"name": "get_weather"' in messages[0]["content"] and "<tool_call>" in messages[0]["content"]
    assert messages[2]["content"] == '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    assert messages[3] == {"role": "user", "content": "<tool_response>\n15:00\n</tool_response>"}


def test_generic_prompt_says_once_that_hermes_stands_in_for_the_named_tool_parser(caplog):
    """The generic prompt asks for Hermes blocks, so hermes parses them even where the server names
    another tool parser: a warning says so (once), instead of the configured parser silently not
    applying; the calls still come back parsed."""
    tm = CannedTM(HERMES_OUT, renders_tools=False)
    oai = openai_client(tm, generic_tool_prompt=True, tool_call_parser="pythonic")
    with caplog.at_level("WARNING", logger="radixserve.server"):
        for _ in range(2):
            r = oai.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS)
            assert calls_of(r.choices[0].message) == EXPECTED_CALLS
    notes = [rec.getMessage() for rec in caplog.records if "generic_tool_prompt" in rec.getMessage()]
    assert len(notes) == 1 and "'pythonic'" in notes[0] and "hermes" in notes[0]
    caplog.clear()
    tm = CannedTM(HERMES_OUT, renders_tools=False)
    with caplog.at_level("WARNING", logger="radixserve.server"):
        openai_client(tm, generic_tool_prompt=True, tool_call_parser="hermes").chat.completions.create(
            model=MODEL, messages=ASK, tools=TOOLS)
    assert not [rec for rec in caplog.records if "generic_tool_prompt" in rec.getMessage()]


def _error(oai, **kw) -> dict:
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=kw.pop("messages", ASK), **kw)
    return e.value.body


@pytest.mark.parametrize("tools,param,words", [
    ([{"type": "retrieval", "function": WEATHER["function"]}], "tools.0.type", "function"),
    ([{"type": "function", "function": {"description": "no name"}}], "tools.0.function.name", "Field required"),
    ([{"type": "function", "function": {"name": "bad name!"}}], "tools.0.function.name", "function names"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}], "tools.0.function.parameters",
     "object"),
    ([{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"unit": {"type": "string", "enum": []}}}}}],
     "tools.0.function.parameters", "properties.unit.enum"),
    ([{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"n": {"type": "integr"}}}}}], "tools.0.function.parameters", "properties.n.type"),
    ([WEATHER, WEATHER], "tools", "unique"),
    # tools audit 30: a dangling $ref was a 200 under tool_choice=auto
    ([{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"$ref": "#/$defs/nope"}}}}}], "tools.0.function.parameters",
     "properties.x.$ref '#/$defs/nope' points to nothing in this schema"),
])
def test_bad_tools_are_a_400_naming_the_field(tools, param, words):
    body = _error(openai_client(CannedTM("x"), tool_call_parser="hermes"), tools=tools)
    assert body["param"] == param and words in body["message"], body


def test_bad_tool_choice_and_history_are_400s():
    oai = openai_client(CannedTM("x"), tool_call_parser="hermes")
    body = _error(oai, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}})
    assert body["param"] == "tool_choice" and "nope" in body["message"]
    assert _error(oai, tool_choice="required")["param"] == "tool_choice"
    bad_args = ASK + [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "get_time", "arguments": "{not json"}}]}]
    assert _error(oai, messages=bad_args, tools=TOOLS)["param"] == "messages.1.tool_calls.0.function.arguments"
    assert "tool_call_id" in _error(oai, messages=[{"role": "tool", "content": "x"}])["message"]
    # audit 30: a tool result answering no call of the assistant message before it was a 200
    called = ASK + [{"role": "assistant", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]}]
    body = _error(oai, messages=called + [{"role": "tool", "tool_call_id": "call_zzz", "content": "15:00"}], tools=TOOLS)
    assert body["param"] == "messages.2.tool_call_id" and "'call_zzz' is not the id of a call" in body["message"]
    assert "'call_1'" in body["message"]
    # session 38: two calls of one message with one id (a tool result could answer either) were a 200
    twice = ASK + [{"role": "assistant", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}},
        {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]}]
    body = _error(oai, messages=twice + [{"role": "tool", "tool_call_id": "call_1", "content": "15:00"}], tools=TOOLS)
    assert body["param"] == "messages.1.tool_calls.1.id" and "'call_1' is the id of tool_calls.0 too" in body["message"]
    assert _error(oai, tools=TOOLS, extra_body={"chat_template_kwargs": {"tools": []}})["param"] == "chat_template_kwargs"
    # no parser configured and none detected
    body = _error(openai_client(CannedTM("x")), tools=TOOLS)
    assert body["param"] == "tools" and "--tool-call-parser" in body["message"] and "hermes" in body["message"]


def test_unknown_parser_name_fails_at_start_up():
    with pytest.raises(Exception, match="no tool_parser component named 'nope'.*hermes"):
        create_app(CannedTM(), Config.build({"server": {"tool_call_parser": "nope"}}))


HAS_GRAMMAR = "grammar" in KINDS and bool(Registry.discover().names("grammar"))


CHOICES = pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "get_weather"}}], ids=["required", "named"]
)


def _constrained(choice, has_grammar: bool = HAS_GRAMMAR) -> tuple[CannedTM, openai.OpenAI, dict]:
    reply = ('[{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}]' if choice == "required"
             else '{"city": "Paris", "unit": "celsius"}')
    tm = CannedTM(reply)
    tm.has_grammar = has_grammar
    return tm, openai_client(tm, tool_call_parser="hermes"), dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice)


@CHOICES
@pytest.mark.parametrize("refused_by", ["validation", "runtime"])
@pytest.mark.skipif(HAS_GRAMMAR, reason="a grammar backend is installed: the constraint is accepted")
def test_required_and_named_without_a_grammar_backend_are_a_clear_400(choice, refused_by, monkeypatch):
    """Never unconstrained text where the client asked for a call: a 400 naming tool_choice,
    whether the request's validation refuses the constraint or the runtime does (streamed or not)."""
    if refused_by == "runtime":
        from dataclasses import replace

        import radixserve.server.openai_serving as serving

        real = serving.check_sampling
        monkeypatch.setattr(serving, "check_sampling", lambda sp, *a: real(replace(sp, json_schema=None), *a))
    tm, oai, kw = _constrained(choice)
    for stream in (False, True):
        body = _error(oai, stream=stream, **{k: v for k, v in kw.items() if k != "model"})
        assert body["param"] == "tool_choice" and "needs a grammar backend" in body["message"], body
    assert all(inp.sampling_params.json_schema for inp in tm.inputs) and len(tm.inputs) == (
        2 if refused_by == "runtime" else 0)


@CHOICES
def test_required_and_named_constrain_the_output_and_parse_it(choice, monkeypatch):
    """The schema handed to the grammar backend, and the parse of the constrained output. Without a
    grammar backend the refusal is lifted here (the canned model writes valid output anyway)."""
    if not HAS_GRAMMAR:
        from dataclasses import replace

        import radixserve.server.openai_serving as serving

        real = serving.check_sampling
        monkeypatch.setattr(serving, "check_sampling", lambda sp, *a: real(replace(sp, json_schema=None), *a))
    tm, oai, kw = _constrained(choice, has_grammar=True)
    r = oai.chat.completions.create(**kw)
    schema = json.loads(tm.inputs[-1].sampling_params.json_schema)
    if choice == "required":
        assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
        variants = schema["items"]["anyOf"]
        assert [v["properties"]["name"]["enum"] for v in variants] == [["get_weather"], ["get_time"]]
        assert variants[0]["properties"]["arguments"] == WEATHER["function"]["parameters"]
        assert variants[0]["required"] == ["name", "arguments"]
    else:
        assert schema == WEATHER["function"]["parameters"]
    # OpenAI: "tool_calls" under required, "stop" under a named function (streamed and not)
    finish = "tool_calls" if choice == "required" else "stop"
    assert calls_of(r.choices[0].message) == [("get_weather", PARIS)]
    assert r.choices[0].message.content is None and r.choices[0].finish_reason == finish
    _, streamed = raw_stream(oai, **kw)
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed["calls"].values()] == [("get_weather", PARIS)]
    assert streamed["content"] == "" and streamed["finish_reason"] == finish


UNIQUE = {"type": "function", "function": {"name": "tag", "parameters": {
    "type": "object", "properties": {"u": {"type": "array", "uniqueItems": True}}}}}
ROOT_BAD = {"type": "function", "function": {"name": "pick", "parameters": {  # xgrammar never writes an undeclared one
    "type": "object", "required": ["b"], "properties": {"a": {"type": "string"}}}}}


class CompilingTM(CannedTM):
    """The canned model behind a real compile of the request's constraint (GrammarService and a real
    backend over the tiny tokenizer), refused the way the runtime refuses it."""

    def __init__(self, backend: str) -> None:
        from radixserve.scheduler.grammar import GrammarService
        from radixserve.testing import tiny_tokenizer
        from radixserve_grammar_llguidance.backend import LLGuidanceBackend
        from radixserve_grammar_xgrammar.backend import XGrammarBackend

        super().__init__('{"u": []}')
        cls = {"xgrammar": XGrammarBackend, "llguidance": LLGuidanceBackend}[backend]
        tok = tiny_tokenizer()
        self.grammar = GrammarService(backend, lambda: cls(tok, len(tok), [tok.eos_token_id]))

    async def generate(self, inp):
        from radixserve.runtime.tokenizer_manager import _runtime_rejection
        from radixserve.scheduler.grammar import GrammarCompileError

        if inp.sampling_params.json_schema is not None:
            try:
                self.grammar.compile("json_schema", inp.sampling_params.json_schema).result()
            except GrammarCompileError as e:
                raise _runtime_rejection(e.message, e.status) from None
        async for out in super().generate(inp):
            yield out


def _named(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


@pytest.mark.skipif(not HAS_GRAMMAR, reason="needs the in-tree grammar backends")
@pytest.mark.parametrize("backend, tools, choice, param, where", [
    ("xgrammar", [UNIQUE], "required", "tools.0.function.parameters", "(at /properties/u/uniqueItems)"),
    ("xgrammar", [WEATHER, TIME, UNIQUE], "required", "tools.2.function.parameters", "(at /properties/u/uniqueItems)"),
    ("xgrammar", [WEATHER, UNIQUE], _named("tag"), "tools.1.function.parameters", "(at /properties/u/uniqueItems)"),
    ("xgrammar", [WEATHER, ROOT_BAD], "required", "tools.1.function.parameters", "(at the schema root;"),
    ("xgrammar", [ROOT_BAD], _named("pick"), "tools.0.function.parameters", "(at the schema root;"),
    ("llguidance", [WEATHER, UNIQUE], _named("tag"), "tools.1.function.parameters", "uniqueItems"),
    ("llguidance", [UNIQUE], "required", "tools.0.function.parameters", "uniqueItems"),
    ("llguidance", [WEATHER, UNIQUE], "required", "tools", "uniqueItems"),  # no location: which tool is unknown
], ids=["one", "third-of-three", "named", "root", "named-root", "llg-named", "llg-one", "llg-unknown"])
def test_a_tool_schema_the_backend_refuses_names_that_tool(backend, tools, choice, param, where):
    """An outside audit: such a tool was answered "tool_choice=required needs a grammar backend ...,
    and this server cannot" (param tool_choice) by a server running xgrammar, with a location in the
    server's wrapper schema (/items/properties/arguments/...)."""
    oai = openai_client(CompilingTM(backend), tool_call_parser="hermes")
    for stream in (False, True):
        body = _error(oai, tools=tools, tool_choice=choice, stream=stream)
        assert body["param"] == param and body["message"].startswith(f"{param}: "), body
        assert where in body["message"] and "the grammar backend refuses it" in body["message"], body
        assert "/items" not in body["message"] and "arguments" not in body["message"], body
        assert "needs a grammar backend" not in body["message"], body


def test_tool_refusals_without_a_working_backend_name_tool_choice():
    from radixserve.server.constraint_errors import tool_choice_refusal

    for message in ("json_schema: structured output needs a grammar backend and this server has none",
                    "json_schema: the grammar backend 'toy' is unavailable: toy init exploded",
                    "json_schema: the grammar backend 'toy' does not support json_schema constraints (it supports regex)"):
        err = tool_choice_refusal(message, "required", [WEATHER], None)
        assert err.param == "tool_choice" and "needs a grammar backend" in err.message, err


def test_wrapper_locations_move_into_the_tool():
    from radixserve.server.tool_schema import locate_in_tools

    defs = {"type": "function", "function": {"name": "d", "parameters": {
        "type": "object", "properties": {"p": {"$ref": "#/$defs/P"}}, "$defs": {"P": {"type": "number"}}}}}
    tools = [WEATHER, defs]
    assert locate_in_tools("x (at /items/anyOf/1/properties/arguments/properties/p)", tools, None) == (
        1, "x (at /properties/p)")
    assert locate_in_tools("x (at /$defs/P; one bound)", tools, None) == (1, "x (at /$defs/P; one bound)")
    assert locate_in_tools("x (at /items/anyOf/0/properties/arguments; y)", tools, None) == (
        0, "x (at the schema root; y)")
    assert locate_in_tools("x (at /items/anyOf/0/properties/name)", tools, None)[0] is None  # the wrapper's own
    assert locate_in_tools("x (at /properties/p)", tools, 1) == (1, "x (at /properties/p)")
    assert locate_in_tools("no location", [WEATHER], None) == (0, "no location")


def _nested(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


@pytest.mark.parametrize("choice", ["auto", "required"])
def test_a_parameters_schema_nested_past_the_limit_is_a_400_before_anything_runs(choice):
    """Fuzz audit 31: 300 levels under `required` were a RecursionError (a 500 with a traceback) copying the
    schema; under `auto` a 15 s request."""
    tm = CannedTM('[{"name": "f", "arguments": {}}]')
    oai = openai_client(tm, tool_call_parser="hermes")
    deep = [{"type": "function", "function": {"name": "f", "parameters": _nested(300)}}]
    body = _error(oai, tools=deep, tool_choice=choice)
    assert body["param"] == "tools.0.function.parameters" and "nested too deeply" in body["message"], body
    assert tm.inputs == []
    from radixserve.server.tool_schema import required_calls_schema

    fine = [{"type": "function", "function": {"name": "f", "parameters": _nested(60)}}]
    required_calls_schema(fine, parallel=True)  # the deepest accepted schema still builds its constraint


def test_required_schema_builder():
    from radixserve.server.tool_schema import required_calls_schema

    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"p": {"$ref": "#/$defs/P"}}, "$defs": {"P": {"type": "string"}}}}}
    schema = json.loads(required_calls_schema([tool], parallel=False))
    assert schema["maxItems"] == 1 and schema["$defs"] == {"P": {"type": "string"}}
    assert "$defs" not in schema["items"]["properties"]["arguments"]
    other = {"type": "function", "function": {"name": "g", "parameters": {"$defs": {"P": {"type": "integer"}}}}}
    with pytest.raises(ValueError, match=r"\$defs.P"):
        required_calls_schema([tool, other], parallel=True)


THINK = "<think>\nThe user wants the weather, so I call the tool.\n</think>\n\n" + HERMES_OUT


def test_reasoning_is_separated_before_tool_parsing_streamed_and_not():
    oai = openai_client(CannedTM(THINK), tool_call_parser="hermes", reasoning_parser="qwen3")
    r = oai.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS)
    msg = r.choices[0].message
    assert msg.reasoning_content == "The user wants the weather, so I call the tool."
    assert msg.content == "I will check both." and calls_of(msg) == EXPECTED_CALLS
    _, streamed = raw_stream(oai, model=MODEL, messages=ASK, tools=TOOLS)
    assert streamed["reasoning_content"] == msg.reasoning_content and streamed["content"] == msg.content
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed["calls"].values()] == EXPECTED_CALLS


def test_reasoning_without_tools_and_separate_reasoning_false():
    text = "<think>\n2 + 2 is 4.\n</think>\n\nThe answer is 4."
    tm = CannedTM(text)
    oai = openai_client(tm, reasoning_parser="qwen3")
    msg = oai.chat.completions.create(model=MODEL, messages=ASK).choices[0].message
    assert (msg.reasoning_content, msg.content) == ("2 + 2 is 4.", "The answer is 4.")
    _, streamed = raw_stream(oai, model=MODEL, messages=ASK)
    assert (streamed["reasoning_content"], streamed["content"]) == ("2 + 2 is 4.", "The answer is 4.")
    msg = oai.chat.completions.create(model=MODEL, messages=ASK, extra_body={"separate_reasoning": False}).choices[0].message
    assert msg.content == text and getattr(msg, "reasoning_content", None) is None
    oai.chat.completions.create(model=MODEL, messages=ASK, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert tm.rendered[-1][1] == {"enable_thinking": False}


def test_reasoning_opened_by_the_prompt_deepseek_style():
    """The generation prompt ends with <think>: the output starts inside the reasoning."""
    tm = CannedTM("Okay, 2 + 2 = 4.\n</think>\n\n**4**", generation_prompt="<｜Assistant｜><think>\n")
    oai = openai_client(tm, reasoning_parser="qwen3")  # qwen3 too starts inside when the prompt opened it
    msg = oai.chat.completions.create(model=MODEL, messages=ASK).choices[0].message
    assert (msg.reasoning_content, msg.content) == ("Okay, 2 + 2 = 4.", "**4**")
    _, streamed = raw_stream(oai, model=MODEL, messages=ASK)
    assert (streamed["reasoning_content"], streamed["content"]) == ("Okay, 2 + 2 = 4.", "**4**")


def test_no_parsers_means_unchanged_output():
    text = "  <think>x</think> <tool_call>{}</tool_call>  "
    oai = openai_client(CannedTM(text))
    msg = oai.chat.completions.create(model=MODEL, messages=ASK).choices[0].message
    assert msg.content == text
    _, streamed = raw_stream(oai, model=MODEL, messages=ASK)
    assert streamed["content"] == text and not streamed["calls"]


def test_serve_refuses_an_unknown_parser_before_loading_the_model():
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "radixserve.cli", "serve", "--reasoning-parser", "nope"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "server.reasoning_parser='nope'" in r.stderr and "qwen3" in r.stderr


def test_constrained_output_is_not_taken_for_reasoning(monkeypatch):
    """deepseek_r1 starts inside the reasoning, but a constrained output starts at its first token."""
    from dataclasses import replace

    import radixserve.server.openai_serving as serving

    if not HAS_GRAMMAR:
        real = serving.check_sampling
        monkeypatch.setattr(serving, "check_sampling", lambda sp, *a: real(replace(sp, json_schema=None), *a))
    tm = CannedTM('[{"name": "get_time", "arguments": {"tz": "UTC"}}]', generation_prompt="<｜Assistant｜><think>\n")
    tm.has_grammar = True
    oai = openai_client(tm, tool_call_parser="hermes", reasoning_parser="deepseek_r1")
    r = oai.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required")
    assert calls_of(r.choices[0].message) == [("get_time", {"tz": "UTC"})]
    assert getattr(r.choices[0].message, "reasoning_content", None) is None


def test_response_format_with_a_reasoning_parser_constrains_only_the_answer():
    """The grammar starts after </think>; from the first token when the prompt closed the section
    or reasoning is not separated."""
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}
    tm = CannedTM('<think>\nfour\n</think>\n{"n": 4}')
    tm.has_grammar = True
    oai = openai_client(tm, reasoning_parser="qwen3")
    msg = oai.chat.completions.create(model=MODEL, messages=ASK, response_format=fmt).choices[0].message
    sp = tm.inputs[-1].sampling_params
    assert json.loads(sp.json_schema) == schema and sp.grammar_after == "</think>"
    assert (msg.reasoning_content, json.loads(msg.content)) == ("four", {"n": 4})
    oai.chat.completions.create(model=MODEL, messages=ASK, response_format=fmt, extra_body={"separate_reasoning": False})
    assert tm.inputs[-1].sampling_params.grammar_after is None
    closed = CannedTM('{"n": 4}', generation_prompt="<|assistant|><think>\n\n</think>\n\n")
    closed.has_grammar = True
    openai_client(closed, reasoning_parser="qwen3").chat.completions.create(model=MODEL, messages=ASK, response_format=fmt)
    assert closed.inputs[-1].sampling_params.grammar_after is None
    plain = CannedTM('{"n": 4}')
    plain.has_grammar = True
    openai_client(plain).chat.completions.create(model=MODEL, messages=ASK, response_format=fmt)  # no reasoning parser
    assert plain.inputs[-1].sampling_params.grammar_after is None


# ---- what a template leaves out is never dropped silently (session 26's client audit) ------------------

CHATML = (  # SmolLM2-135M-Instruct's template: ChatML with a default system prompt, no tools, no tool calls
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are SmolLM.<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
WITH_DEVELOPER = (  # a template with a rendering of its own for `developer` (as gpt-oss's has)
    "{% for message in messages %}{% if message['role'] == 'developer' %}{{ '[DEV] ' + message['content'] + '\\n' }}"
    "{% else %}{{ message['role'] + ': ' + message['content'] + '\\n' }}{% endif %}{% endfor %}"
)


class JinjaTM(CannedTM):
    """The canned runtime with a real Jinja chat template (rendered as transformers does: the
    template sees only what it names)."""

    def __init__(self, template: str, reply: str = "ok", **kw) -> None:
        super().__init__(reply, chat_template=template, **kw)
        import jinja2

        self._template = jinja2.Environment().from_string(template)

    def apply_chat_template(self, messages, add_generation_prompt=True, **kwargs):
        self.rendered.append((messages, kwargs))
        return self.tokenizer.encode(self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                                           **kwargs))

    def prompt(self) -> str:
        return self.tokenizer.decode(self.inputs[-1].input_ids)


CALL_HISTORY = ASK + [
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
]


def test_earlier_tool_calls_a_template_cannot_show_are_a_400_not_dropped():
    """The audit's case: the last turn sent without `tools` (to force a text answer) rendered the
    assistant turn empty, the call's name and arguments gone, and answered 200."""
    tm = JinjaTM(CHATML)
    body = _error(openai_client(tm), messages=CALL_HISTORY)
    assert body["param"] == "messages.1.tool_calls", body
    assert "does not render tool calls" in body["message"] and "generic_tool_prompt" in body["message"]
    assert tm.inputs == []
    # under the generic tool prompt they are written as the Hermes blocks that prompt asks for
    tm = JinjaTM(CHATML)
    r = openai_client(tm, generic_tool_prompt=True).chat.completions.create(model=MODEL, messages=CALL_HISTORY)
    assert r.choices[0].message.content == "ok"
    prompt = tm.prompt()
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt, prompt
    assert "<|im_start|>user\n<tool_response>\n18C\n</tool_response>" in prompt, prompt
    assert "<tools>" not in prompt  # no tools in this request: none are offered


def test_a_template_that_shows_tool_calls_gets_them_without_tools():
    tm = CannedTM("ok")  # renders every message field
    r = openai_client(tm).chat.completions.create(model=MODEL, messages=CALL_HISTORY)
    assert r.choices[0].message.content == "ok"
    messages, kwargs = tm.rendered[-1]
    assert "tools" not in kwargs and messages[1]["tool_calls"][0]["function"]["name"] == "get_weather"


def test_developer_messages_are_system_ones_unless_the_template_knows_the_role():
    tm = JinjaTM(CHATML)
    openai_client(tm).chat.completions.create(
        model=MODEL, messages=[{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert tm.prompt() == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    tm = JinjaTM(WITH_DEVELOPER)
    openai_client(tm).chat.completions.create(
        model=MODEL, messages=[{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert tm.prompt() == "[DEV] Be brief.\nuser: Hi\n"


def test_text_parts_are_joined_by_a_newline():
    tm = JinjaTM(CHATML)
    parts = [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]
    openai_client(tm).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": parts}])
    assert "<|im_start|>user\nHi\nthere<|im_end|>" in tm.prompt()


GEMMA3_STYLE = (  # reads content itself: a string, or a list of parts (Gemma 3's, Llama 4's templates)
    "{% for message in messages %}{{ '<start_of_turn>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] | trim }}"
    "{% else %}{% for item in message['content'] %}{% if item['type'] == 'text' %}{{ item['text'] | trim }}{% endif %}"
    "{% endfor %}{% endif %}{{ '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)


def test_a_template_that_reads_the_parts_gets_the_list():
    """Chat audit 33: the parts were joined with a newline before every template, so one that loops over them
    rendered 'part one\npart two' where transformers (given the list) renders 'part onepart two'."""
    import jinja2

    tm = JinjaTM(GEMMA3_STYLE)
    parts = [{"type": "text", "text": "part one"}, {"type": "text", "text": "part two"}]
    messages = [{"role": "user", "content": parts}, {"role": "assistant", "content": "ok"},
                {"role": "user", "content": "again"}]
    openai_client(tm).chat.completions.create(model=MODEL, messages=messages)
    assert tm.prompt() == jinja2.Environment().from_string(GEMMA3_STYLE).render(messages=messages,
                                                                                add_generation_prompt=True)
    assert "part onepart two" in tm.prompt()


HERMES_TOOL_USE = (  # a Hermes-2-Pro-style `tool_use` template: tools in the system turn, calls as <tool_call> blocks
    "{{ '<|im_start|>system\\n<tools>' + (tools | tojson) + '</tools><|im_end|>\\n' }}"
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message.get('tool_calls') %}{% for call in message['tool_calls'] %}"
    "{{ '<tool_call>' + call['function']['name'] + '</tool_call>' }}{% endfor %}"
    "{% else %}{{ message['content'] }}{% endif %}{{ '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


class NamedTemplatesTM(JinjaTM):
    """A checkpoint that ships named chat templates (Hermes-2-Pro, Command-R): `default` without tools,
    `tool_use` with them; rendered as transformers does (the tool_use one when `tools` are given)."""

    def __init__(self, reply: str = "ok") -> None:
        super().__init__(CHATML, reply)
        import jinja2

        self.tokenizer.chat_template = {"default": CHATML, "tool_use": HERMES_TOOL_USE}
        self._named = {name: jinja2.Environment().from_string(text)
                       for name, text in self.tokenizer.chat_template.items()}

    def apply_chat_template(self, messages, add_generation_prompt=True, **kwargs):
        self.rendered.append((messages, kwargs))
        template = self._named["tool_use" if kwargs.get("tools") is not None else "default"]
        return self.tokenizer.encode(template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                                     **kwargs))


def test_named_chat_templates_serve_the_tool_loop():
    """Chat audit 33: with `default` + `tool_use` templates, the parser was not detected (the template texts were
    not read) and the tool result's turn was a 400 'does not render tool calls' (probed on `default` alone)."""
    tm = NamedTemplatesTM(HERMES_OUT)
    oai = openai_client(tm)  # no --tool-call-parser: found in the tool_use template's <tool_call>
    first = oai.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS)
    assert [name for name, _ in calls_of(first.choices[0].message)] == ["get_weather", "get_time"]
    tm.reply = "It is 18C."
    second = oai.chat.completions.create(model=MODEL, messages=CALL_HISTORY, tools=TOOLS)
    assert second.choices[0].message.content == "It is 18C."
    assert "<tool_call>get_weather</tool_call>" in tm.prompt()
    # without tools the default template renders, which cannot show the call: still refused, naming the message
    assert _error(oai, messages=CALL_HISTORY)["param"] == "messages.1.tool_calls"


def test_tokenize_renders_as_the_chat_route_under_tool_choice_none():
    """Chat audit 33: /tokenize refused tool_choice, so a prompt sent with tool_choice "none" (tools hidden)
    could not be reproduced (162 tokens counted with the tools against the chat route's 33)."""
    tm = JinjaTM(CHATML)
    oai = openai_client(tm)
    oai.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none")
    http = oai._client
    r = http.post("http://testserver/tokenize", json={"messages": ASK, "tools": TOOLS, "tool_choice": "none"})
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == list(tm.inputs[-1].input_ids)
