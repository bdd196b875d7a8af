"""Each tool-call parser and the reasoning parsers on recorded-style outputs of their model family
(calls alone, several calls, text before/between/after, malformed JSON, unknown names, output cut
short), parsed whole and streamed split at every position (radixserve.testing's kit), plus the
stream assembler that turns parser snapshots into OpenAI deltas."""

from __future__ import annotations

import json

import pytest
from radixserve.plugins.registry import Registry
from radixserve.server.chat_output import ChoiceOutput
from radixserve.server.reasoning import DeepSeekR1ReasoningParser, Qwen3ReasoningParser
from radixserve.server.tool_parsers.constrained import NamedCallParser, RequiredCallsParser
from radixserve.server.tool_parsers.hermes import HermesToolParser
from radixserve.server.tool_parsers.llama3_json import Llama3JsonToolParser
from radixserve.server.tool_parsers.mistral import MistralToolParser
from radixserve.server.tool_parsers.pythonic import PythonicToolParser
from radixserve.testing.output_parsers import (
    ReasoningSample,
    ToolSample,
    check_reasoning_parser,
    check_tool_parser,
)

TOOLS = ["get_weather", "get_time", "search"]
PARIS = {"city": "Paris", "unit": "celsius"}

HERMES = [
    # Qwen2.5-7B-Instruct, one call
    ToolSample('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>',
               [("get_weather", PARIS)]),
    # text first, then two calls (parallel), as Hermes-2-Pro writes them
    ToolSample('Let me check both.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
               '"unit": "celsius"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}'
               "\n</tool_call>",
               [("get_weather", PARIS), ("get_time", {"tz": "Europe/Paris"})], "Let me check both."),
    # nested arguments with braces and a tag inside strings, unicode
    ToolSample('<tool_call>{"name": "search", "arguments": {"q": "a {b} </tool_call-like> \\"c\\" é", '
               '"filters": {"year": [2023, 2024], "exact": true}}}</tool_call>',
               [("search", {"q": 'a {b} </tool_call-like> "c" é', "filters": {"year": [2023, 2024], "exact": True}})]),
    # the model stopped right after the JSON (stop token before </tool_call>)
    ToolSample('<tool_call>\n{"name": "get_time", "arguments": {}}\n', [("get_time", {})]),
    # arguments sent as a JSON-encoded string; no arguments at all
    ToolSample('<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}</tool_call>'
               '<tool_call>{"name": "get_time"}</tool_call>',
               [("get_weather", {"city": "Paris"}), ("get_time", {})]),
    # malformed JSON: content, markup included; the valid call after it still counts
    ToolSample('<tool_call>{"name": "get_weather", "arguments": {"city": }}</tool_call>\nok '
               '<tool_call>{"name": "get_time", "arguments": {"tz": "UTC"}}</tool_call>',
               [("get_time", {"tz": "UTC"})],
               '<tool_call>{"name": "get_weather", "arguments": {"city": }}</tool_call>\nok'),
    # a function the request did not offer: content
    ToolSample('<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', [],
               '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>'),
    # cut short by max_tokens inside the arguments: content
    ToolSample('Sure. <tool_call>{"name": "get_weather", "arguments": {"city": "Par', [],
               'Sure. <tool_call>{"name": "get_weather", "arguments": {"city": "Par'),
    # plain answers, one with a lone '<'
    ToolSample("The weather in Paris is mild, 3 < 5.", [], "The weather in Paris is mild, 3 < 5."),
    ToolSample("Answer: <tool", [], "Answer: <tool"),
]

LLAMA3 = [
    # Llama-3.1-8B-Instruct custom tool call
    ToolSample('{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}', [("get_weather", PARIS)]),
    # with <|python_tag|> (skip_special_tokens=false), two calls separated by ';'
    ToolSample('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; '
               '{"name": "get_time", "parameters": {"tz": "CET"}}',
               [("get_weather", PARIS), ("get_time", {"tz": "CET"})]),
    # text before the tag
    ToolSample('I will look it up.<|python_tag|>{"name": "search", "parameters": {"q": "llamas"}}',
               [("search", {"q": "llamas"})], "I will look it up."),
    # "arguments" instead of "parameters" (Llama 3.2 sometimes)
    ToolSample('  {"name": "get_time", "arguments": {"tz": "UTC"}}', [("get_time", {"tz": "UTC"})]),
    # a JSON answer that is not a call: content
    ToolSample('{"answer": 42}', [], '{"answer": 42}'),
    # malformed: content
    ToolSample('{"name": "get_time", "parameters": {"tz": "UTC"}', [], '{"name": "get_time", "parameters": {"tz": "UTC"}'),
    # builtin python code after the tag: content
    ToolSample("<|python_tag|>print(1)", [], "<|python_tag|>print(1)"),
    ToolSample("It is sunny in Paris.", [], "It is sunny in Paris."),
]

MISTRAL = [
    # Mistral-7B-Instruct-v0.3
    ToolSample('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}]',
               [("get_weather", PARIS)]),
    # two calls, with ids (Mixtral-8x22B writes an "id" too)
    ToolSample('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}, "id": "a1B2c3D4e"}, '
               '{"name": "get_time", "arguments": {"tz": "CET"}, "id": "f5G6h7I8j"}]',
               [("get_weather", PARIS), ("get_time", {"tz": "CET"})]),
    # text before the calls
    ToolSample('Checking.[TOOL_CALLS] [{"name": "search", "arguments": {"q": "mistral"}}]',
               [("search", {"q": "mistral"})], "Checking."),
    # tokenizer v11 format: name[ARGS]{...}, one [TOOL_CALLS] per call
    ToolSample('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}[TOOL_CALLS]get_time[ARGS]{"tz": "CET"}',
               [("get_weather", PARIS), ("get_time", {"tz": "CET"})]),
    # malformed: content
    ToolSample('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"]', [],
               '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"]'),
    ToolSample("[1, 2] is a list; [TOOLS] is not a tag.", [], "[1, 2] is a list; [TOOLS] is not a tag."),
]

PYTHONIC = [
    # Llama-3.2-3B-Instruct with the pythonic template
    ToolSample('[get_weather(city="Paris", unit="celsius")]', [("get_weather", PARIS)]),
    # two calls, all literal types, a ')' and ',' inside strings
    ToolSample("[get_weather(city='Paris', unit=\"celsius\"), search(q='a), b', n=3, exact=True, tags=['x', None], "
               "opts={'k': 1.5})]",
               [("get_weather", PARIS), ("search", {"q": "a), b", "n": 3, "exact": True, "tags": ["x", None],
                                                    "opts": {"k": 1.5}})]),
    # text before, Llama 4 wrapper tags
    ToolSample("Let me check.\n<|python_start|>[get_time(tz=\"UTC\")]<|python_end|>", [("get_time", {"tz": "UTC"})],
               "Let me check."),
    ToolSample("[get_time()]", [("get_time", {})]),
    # positional arguments / an expression: not a pythonic call list -> content (never evaluated)
    ToolSample('[get_weather("Paris")]', [], '[get_weather("Paris")]'),
    ToolSample("[get_time(tz=__import__('os').system('true'))]", [], "[get_time(tz=__import__('os').system('true'))]"),
    ToolSample("[unknown_fn(a=1)]", [], "[unknown_fn(a=1)]"),
    ToolSample("Lists look like [1, 2] in Python.", [], "Lists look like [1, 2] in Python."),
]


@pytest.mark.parametrize(
    "cls,samples",
    [(HermesToolParser, HERMES), (Llama3JsonToolParser, LLAMA3), (MistralToolParser, MISTRAL),
     (PythonicToolParser, PYTHONIC)],
    ids=["hermes", "llama3_json", "mistral", "pythonic"],
)
def test_tool_parser_whole_and_streamed_at_every_split(cls, samples):
    check_tool_parser(cls, samples, TOOLS)


def test_constrained_parsers():
    required = [
        ToolSample('[{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
                   '{"name": "get_time", "arguments": {"tz": "CET"}}]',
                   [("get_weather", PARIS), ("get_time", {"tz": "CET"})]),
        ToolSample('[{"name": "get_weather", "arguments": {"city": "Pa', [], '[{"name": "get_weather", "arguments": {"city": "Pa'),
    ]
    check_tool_parser(RequiredCallsParser, required, TOOLS)
    named = [
        ToolSample('{"city": "Paris", "unit": "celsius"}', [("get_weather", PARIS)]),
        ToolSample('{"city": "Par', [], '{"city": "Par'),
    ]
    check_tool_parser(NamedCallParser, named, ["get_weather"])


def test_reasoning_parsers_whole_and_streamed():
    check_reasoning_parser(Qwen3ReasoningParser, [
        ReasoningSample("<think>\nThe user wants 2+2.\n</think>\n\n2 + 2 = 4.", "The user wants 2+2.", "2 + 2 = 4."),
        ReasoningSample("2 + 2 = 4.", "", "2 + 2 = 4."),  # enable_thinking=false: no section
        ReasoningSample("<think>\nstill thinking when max_tokens hit", "still thinking when max_tokens hit", ""),
        ReasoningSample("the prompt opened it</think>answer", "the prompt opened it", "answer", starts_in_reasoning=True),
        ReasoningSample("a < b and </thinking> is not the tag", "", "a < b and </thinking> is not the tag"),
    ])
    check_reasoning_parser(DeepSeekR1ReasoningParser, [
        ReasoningSample("Okay, so 2+2 is 4.\n</think>\n\nThe answer is **4**.", "Okay, so 2+2 is 4.", "The answer is **4**."),
        ReasoningSample("<think>\nhmm\n</think>4", "hmm", "4"),  # older R1: writes the tag itself
        ReasoningSample("no end tag: all reasoning", "no end tag: all reasoning", ""),
    ])


def _stream(output: ChoiceOutput, text: str, step: int) -> dict:
    """Feed `text` in chunks of `step` characters and assemble the deltas as OpenAI's client does."""
    got = {"reasoning": "", "content": "", "calls": {}}
    cuts = list(range(step, len(text), step)) + [len(text)]
    for k in cuts:
        d = output.delta(text[:k], final=k == len(text))
        got["reasoning"] += d.reasoning
        got["content"] += d.content
        for c in d.calls:
            if c.id is not None:
                assert c.index not in got["calls"] and c.name and c.arguments == ""  # first delta: id + name
                got["calls"][c.index] = {"id": c.id, "name": c.name, "arguments": ""}
            else:
                assert c.name is None
                got["calls"][c.index]["arguments"] += c.arguments
    return got


@pytest.mark.parametrize("step", [1, 3, 7, 1000])
def test_assembler_reasoning_then_tool_calls(step):
    text = ("<think>\nThe user asks for the weather; I should call the tool.\n</think>\n\n"
            "I'll check.\n<tool_call>\n"
            '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>')

    def make():
        return ChoiceOutput(Qwen3ReasoningParser(), HermesToolParser(TOOLS))

    whole = make().finish(text)
    assert whole.reasoning == "The user asks for the weather; I should call the tool."
    assert whole.content == "I'll check."
    assert [(c.name, json.loads(c.arguments)) for c in whole.calls] == [("get_weather", PARIS), ("get_time", {"tz": "CET"})]
    assert all(c.id.startswith("call_") for c in whole.calls) and len({c.id for c in whole.calls}) == 2
    streamed = _stream(make(), text, step)
    assert streamed["reasoning"] == whole.reasoning and streamed["content"] == whole.content
    assert [(c["name"], c["arguments"]) for c in streamed["calls"].values()] == [(c.name, c.arguments) for c in whole.calls]
    assert "<tool_call>" not in streamed["content"] and "<think>" not in streamed["reasoning"]


def test_assembler_parallel_false_keeps_one_call_and_only_calls_give_null_content():
    text = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call><tool_call>{"name": "search", "arguments": {}}</tool_call>'
    parts = ChoiceOutput(None, HermesToolParser(TOOLS), max_calls=1).finish(text)
    assert parts.content is None and [c.name for c in parts.calls] == ["get_time"]
    assert list(_stream(ChoiceOutput(None, HermesToolParser(TOOLS), max_calls=1), text, 2)["calls"]) == [0]


def test_builtin_parsers_are_registered_and_detected_from_templates():
    reg = Registry.discover()
    assert set(reg.names("tool_parser")) >= {"hermes", "llama3_json", "mistral", "pythonic"}
    assert set(reg.names("reasoning_parser")) >= {"qwen3", "deepseek_r1"}
    # excerpts of the chat templates of each family
    qwen25 = "{{- '<tool_call>\\n{\"name\": \"' }}{{- tool_call.name }}... <tools></tools>"
    llama31 = '<|start_header_id|>assistant<|end_header_id|>\\n\\n{{- \'{"name": "\' + tool_call.name + \'", \' }}{{- \'"parameters": \' }}'
    mistral = "[AVAILABLE_TOOLS] {{- tools|tojson }}[/AVAILABLE_TOOLS]{{- '[TOOL_CALLS] ' }}"
    pythonic = "[func_name1(params_name1=params_value1, params_name2=params_value2...), func_name2(params)]"

    def detect(kind, template):
        return [s.name for s in reg.components(kind) if reg.load(kind, s.name).matches_template(template)][:1]

    assert detect("tool_parser", qwen25) == ["hermes"]
    assert detect("tool_parser", llama31) == ["llama3_json"]
    assert detect("tool_parser", mistral) == ["mistral"]
    assert detect("tool_parser", pythonic) == ["pythonic"]
    assert detect("tool_parser", "{{ message['content'] }}") == []
    assert detect("reasoning_parser", "{%- if '</think>' in content %}<think>") == ["qwen3"]
    assert detect("reasoning_parser", "<｜Assistant｜>{{ content.split('</think>')[-1] }}") == ["deepseek_r1"]


@pytest.mark.parametrize(
    "cls,samples",
    [(HermesToolParser, HERMES), (Llama3JsonToolParser, LLAMA3), (MistralToolParser, MISTRAL),
     (PythonicToolParser, PYTHONIC)],
    ids=["hermes", "llama3_json", "mistral", "pythonic"],
)
def test_streamed_deltas_assemble_to_the_non_streamed_message(cls, samples):
    """Token by token through the assembler: the client ends with the non-streamed message, except
    that a call streamed before it turned out malformed stays with the client (it cannot be taken
    back); its text still arrives as content."""
    for sample in samples:
        whole = ChoiceOutput(None, cls(TOOLS)).finish(sample.text)
        got = _stream(ChoiceOutput(None, cls(TOOLS)), sample.text, 1)
        assert got["content"] == (whole.content or ""), sample.text
        calls = [(c["name"], c["arguments"]) for c in got["calls"].values()]
        expected = [(c.name, c.arguments) for c in whole.calls]
        ghosts = [c for c in calls if c not in expected]  # streamed, then found malformed
        assert [c for c in calls if c in expected] == expected, sample.text
        assert all(not _is_object(args) for _, args in ghosts), sample.text
        if ghosts:
            assert sample.content, "a ghost call's text must come back as content"


def _is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def test_the_docs_example_parser_conforms():
    """docs/tools-and-reasoning.md's "Adding a parser" example passes the kit it documents."""
    from pathlib import Path

    doc = (Path(__file__).resolve().parent.parent / "docs" / "tools-and-reasoning.md").read_text()
    blocks = doc.split("```python\n")[1:]
    source = next(b.split("```")[0] for b in blocks if "class XmlCallParser" in b)
    test = next(b.split("```")[0] for b in blocks if "check_tool_parser(XmlCallParser" in b)
    namespace: dict = {}
    exec(compile(source, "docs-example", "exec"), namespace)
    test = test.replace("from my_parsers.xml import XmlCallParser\n", "")
    exec(compile(test, "docs-example-test", "exec"), namespace)
    namespace["test_xml_calls"]()


class _IgnoresFinal(HermesToolParser):
    """Streams an open call's markup as content (it parses every prefix as if it were the end)."""

    def parse(self, text, final):
        return super().parse(text, True)


class _RenamesAtTheEnd(HermesToolParser):
    """Streams the call under another name than the one it returns at the end."""

    def parse(self, text, final):
        got = super().parse(text, final)
        if final or not got.calls:
            return got
        first = got.calls[0]
        return type(got)(got.content, (type(first)("search", first.arguments), *got.calls[1:]))


class _ArgumentsShrinkAtTheEnd(HermesToolParser):
    def parse(self, text, final):
        got = super().parse(text, final)
        if final or not got.calls:
            return got
        first = got.calls[0]
        return type(got)(got.content, (type(first)(first.name, first.arguments + " "), *got.calls[1:]))


class _RaisesOnPartialInput(HermesToolParser):
    def parse(self, text, final):
        if not final and "<tool_call>" in text:
            raise ValueError("partial markup")
        return super().parse(text, final)


class _ReturnsADict(HermesToolParser):
    def parse(self, text, final):
        return {"content": text, "calls": []}


@pytest.mark.parametrize(("broken", "says"), [
    # parsers audit 32: the kit showed a bare ValueError / AttributeError, without the case
    (_RaisesOnPartialInput, r"sample 0 \('Hi <tool_call>.*after \d+ characters: parse\(\.\.\., final=False\) raised "
                            r"ValueError: partial markup"),
    (_ReturnsADict, r"sample 0 .*, whole: parse returned dict, not a ToolParse"),
    (_IgnoresFinal, "does not extend the content already streamed"),
    (_RenamesAtTheEnd, "was streamed and dropped, but its text never became content"),
    (_ArgumentsShrinkAtTheEnd, "do not extend the streamed"),
])
def test_the_kit_holds_the_final_snapshot_to_what_was_streamed(broken, says):
    """Audit 30: parsers that leak markup while streaming, or rename a streamed call at the end, passed
    check_tool_parser (it compared streamed snapshots with each other, never the final one with them)."""
    sample = [ToolSample('Hi <tool_call>{"name": "get_time", "arguments": {}}</tool_call>', [("get_time", {})], "Hi")]
    check_tool_parser(HermesToolParser, sample, TOOLS)  # the sample itself is fine
    with pytest.raises(AssertionError, match=says):
        check_tool_parser(broken, sample, TOOLS)


def test_a_call_dropped_as_malformed_does_not_make_the_stream_end_with_tool_calls():
    """Tools audit 30: streamed, a call whose arguments turned out malformed ended the stream with
    finish_reason "tool_calls" while the same answer unstreamed said "stop" (no calls)."""
    text = 'Hi!\n<tool_call>\n{"name": "get_time", "arguments": {"tz": CET}}\n</tool_call>'
    assert ChoiceOutput(None, HermesToolParser(TOOLS)).finish(text).calls == []
    streamed = ChoiceOutput(None, HermesToolParser(TOOLS))
    for k in range(1, len(text)):
        streamed.delta(text[:k], False)
    assert streamed.has_calls  # get_time was streamed before its arguments broke
    streamed.delta(text, True)
    assert not streamed.has_calls  # the finish reason follows the final parse, as unstreamed


class _ContractBreaker(HermesToolParser):
    """A third-party parser's bugs, one at a time (parsers audit 32)."""

    bug = ""

    def parse(self, text, final):
        from radixserve.interfaces.tool_parser import ParsedToolCall, ToolParse

        if self.bug == "raises":
            raise KeyError("parser bug")
        if self.bug == "not_json":
            return ToolParse("", (ParsedToolCall("get_weather", "not json {"),))
        if self.bug == "unoffered":
            return ToolParse("", (ParsedToolCall("hacked_fn", "[1]"),))
        return super().parse(text, final)


@pytest.mark.parametrize("bug", ["not_json", "unoffered"])
def test_calls_breaking_the_parser_contract_never_reach_the_client(bug, caplog):
    """A parser that returned non-JSON arguments, or a function the request did not offer, had them
    sent as tool_calls (streamed: arguments ""), with nothing in the log."""
    class Broken(_ContractBreaker):
        pass

    Broken.bug = bug
    parser = Broken
    with caplog.at_level("WARNING", logger="radixserve.server"):
        whole = ChoiceOutput(None, parser(["get_weather"])).finish("anything")
        streamed = ChoiceOutput(None, parser(["get_weather"]))
        deltas = [streamed.delta("any", False), streamed.delta("anything", True)]
    assert whole.calls == []
    assert (bug == "not_json") == bool([c for d in deltas for c in d.calls])  # a valid name streams before the end
    assert not streamed.has_calls  # the finish reason is not tool_calls
    assert "Broken (test_tool_parsers) returned a call the contract forbids" in caplog.text


def test_a_raising_parser_is_named_in_the_error():
    class Raising(_ContractBreaker):
        bug = "raises"

    with pytest.raises(RuntimeError, match=r"the tool parser test_a_raising_parser_is_named_in_the_error.<locals>.Raising "
                                           r"\(test_tool_parsers\) failed: KeyError"):
        ChoiceOutput(None, Raising(["get_weather"])).finish("anything")
