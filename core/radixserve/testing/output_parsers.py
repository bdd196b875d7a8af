"""Conformance kits of the chat output parsers (`ToolParser`, `ReasoningParser`).

    from radixserve.testing import ToolSample, check_tool_parser
    def test_my_parser():
        check_tool_parser(MyParser, [ToolSample('<call>{"name": "f"}</call>', calls=[("f", {})])], ["f"])

Each sample is parsed whole (`final=True`) and must give the expected content and calls; then it is
fed the way the server streams it, growing one character at a time and split once at every
position, and each step must keep the contract's prefix stability, ending with the same result."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from radixserve.interfaces.reasoning_parser import ReasoningParser
from radixserve.interfaces.tool_parser import ToolParse, ToolParser
from radixserve.testing._hooks import call_hook


@dataclass
class ToolSample:
    text: str
    calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)  # (name, arguments)
    content: str = ""  # compared after stripping surrounding whitespace


def _streamed(parser: ToolParser, text: str, cuts: Sequence[int], where: str) -> ToolParse:
    """Parse growing prefixes ending at `cuts` (then the whole text, final) checking stability. The
    final snapshot is held to it too: the server cannot take back what it streamed (audit 30: a parser
    streaming its markup as content, or a call it renamed at the end, passed)."""
    prev = ToolParse()
    dropped: tuple[int, str] | None = None  # content length before the first dropped call, and the step
    for k in [*cuts, len(text)]:
        final = k == len(text)
        step = f"{where}, after {k} characters{' (final)' if final else ''}"
        now = _parse(parser, text[:k], final, step)
        assert now.content.startswith(prev.content), (
            f"{step}: content {now.content!r} does not extend the content already streamed, {prev.content!r}")
        kept = 0
        for a, b in zip(prev.calls, now.calls):
            if a.name != b.name:
                break  # call `kept` was dropped (malformed): what follows it is new
            assert b.arguments.startswith(a.arguments), (
                f"{step}: arguments of call {kept} ({b.name}) {b.arguments!r} do not extend the streamed {a.arguments!r}")
            kept += 1
        if kept < len(prev.calls) and dropped is None:
            dropped = (len(prev.content), f"{step}: call {kept} ({prev.calls[kept].name}, arguments "
                                          f"{prev.calls[kept].arguments!r}) was streamed and dropped")
        prev = now
    if dropped is not None:  # a dropped call's text becomes content, at the latest with final=True
        assert len(prev.content) > dropped[0], (
            f"{dropped[1]}, but its text never became content (final content {prev.content!r}): a streamed call "
            "cannot be renamed or taken back, so hold a call back until its name is complete")
    return prev


def _parse(parser: ToolParser, text: str, final: bool, step: str) -> ToolParse:
    """parser.parse with the case named when it raises or returns something else than a ToolParse
    (parsers audit 32: the kit showed a bare AttributeError / ValueError)."""
    out = call_hook(parser.parse, text, final, where=f"{step}: parse(..., final={final})")
    assert isinstance(out, ToolParse), f"{step}: parse returned {type(out).__name__}, not a ToolParse"
    return out


def _arguments(name: str, arguments: Any, where: str) -> Any:
    try:
        return json.loads(arguments)
    except (TypeError, ValueError) as e:
        raise AssertionError(f"{where}: arguments of {name} are not JSON ({arguments!r}: {e})") from None


def check_tool_parser(parser_cls: type[ToolParser], samples: Sequence[ToolSample], tool_names: Sequence[str]) -> None:
    """Every sample parses to its content and calls, whole and streamed (prefix-stable)."""
    for n, sample in enumerate(samples):
        where = f"sample {n} ({sample.text[:40]!r}...)"
        parser = parser_cls(tool_names)
        whole = _parse(parser, sample.text, True, f"{where}, whole")
        got = [(c.name, _arguments(c.name, c.arguments, where)) for c in whole.calls]
        assert got == [(name, args) for name, args in sample.calls], f"{where}: calls {got}, expected {sample.calls}"
        assert whole.content.strip() == sample.content.strip(), f"{where}: content {whole.content!r}, expected {sample.content!r}"
        for name, args in got:
            assert isinstance(args, dict), f"{where}: arguments of {name} are not an object"
        cuts_list = [list(range(len(sample.text)))] + [[k] for k in range(len(sample.text))]
        for cuts in cuts_list:
            streamed = _streamed(parser_cls(tool_names), sample.text, cuts, where)
            assert streamed == whole, f"{where}: streamed with cuts {cuts[:5]}... ends as {streamed}, whole gives {whole}"


@dataclass
class ReasoningSample:
    text: str
    reasoning: str
    content: str
    starts_in_reasoning: bool | None = None  # None: the parser's default


def _split(parser: ReasoningParser, text: str, final: bool, step: str) -> tuple[str, str]:
    out = call_hook(parser.split, text, final, where=f"{step}: split(..., final={final})")
    assert isinstance(out, tuple) and len(out) == 2 and all(isinstance(x, str) for x in out), (
        f"{step}: split returned {out!r}, not a (reasoning, content) pair of strings")
    return out


def check_reasoning_parser(parser_cls: type[ReasoningParser], samples: Sequence[ReasoningSample]) -> None:
    """Every sample splits into its reasoning and content (stripped), whole and streamed."""
    for n, sample in enumerate(samples):
        where = f"sample {n} ({sample.text[:40]!r}...)"
        start = {} if sample.starts_in_reasoning is None else {"starts_in_reasoning": sample.starts_in_reasoning}
        parser = parser_cls(**start)
        reasoning, content = _split(parser, sample.text, True, f"{where}, whole")
        assert (reasoning.strip(), content.strip()) == (sample.reasoning.strip(), sample.content.strip()), (
            f"{where}: got {(reasoning, content)}, expected {(sample.reasoning, sample.content)}"
        )
        prev = ("", "")
        for k in range(len(sample.text) + 1):
            now = _split(parser, sample.text[:k], k == len(sample.text), f"{where}, after {k} characters")
            if k < len(sample.text):
                assert now[0].startswith(prev[0]) and now[1].startswith(prev[1]), (
                    f"{where}, after {k} characters: {now} does not extend {prev}"
                )
            prev = now
        assert prev == (reasoning, content), f"{where}: streamed ends as {prev}, whole gives {(reasoning, content)}"
