"""Pythonic format (Llama 3.2 / Llama 4 pythonic templates, several small models): a Python list of
calls with keyword arguments, `[get_weather(city="Paris"), get_time(tz="CET")]`, at the end of the
output (text before it is content). Read with `ast` and `ast.literal_eval`: nothing is evaluated."""

from __future__ import annotations

import ast
import json
import re

from radixserve.interfaces.tool_parser import ParsedToolCall, ToolParse, ToolParser
from radixserve.server.tool_parsers.common import content_before

_LIST_START = re.compile(r"\[\s*[A-Za-z_][\w.]*\s*\(")
_MAYBE_LIST_START = re.compile(r"\[\s*(?:[A-Za-z_][\w.]*\s*)?$")  # what may still become one
_NAME = re.compile(r"[A-Za-z_][\w.]*")
_WRAP = ("<|python_start|>", "<|python_end|>")  # Llama 4 may wrap the list in these


class _Invalid(Exception):
    pass


class PythonicToolParser(ToolParser):
    template_markers = ("[func_name1(", "<|python_start|>")

    def parse(self, text: str, final: bool) -> ToolParse:
        for tag in _WRAP:  # markup only; the list inside is what counts
            text = text.replace(tag, "")
        m = _LIST_START.search(text)
        if m is None:
            return ToolParse(self._content(text, final), ())
        prefix = text[: m.start()]
        calls: list[ParsedToolCall] = []
        try:
            end = self._calls(text, m.start() + 1, final, calls)
        except _Invalid:
            return ToolParse(text if final else prefix, () if final else tuple(calls))
        if end is None:
            return ToolParse(prefix, tuple(calls))
        return ToolParse(prefix + self._content(text[end:], final), tuple(calls))

    def _content(self, text: str, final: bool) -> str:
        text = content_before(text, final, *_WRAP)
        hold = _MAYBE_LIST_START.search(text)
        return text if final or hold is None else text[: hold.start()]

    def _calls(self, text: str, i: int, final: bool, calls: list[ParsedToolCall]) -> int | None:
        """Read `name(...)` items from text[i] to the closing ']'; its end (None: not there yet)."""
        while True:
            i = _skip_ws(text, i)
            name = _NAME.match(text, i)
            if name is None or name.end() >= len(text):
                return _more(final)
            paren = _skip_ws(text, name.end())
            if paren >= len(text):
                return _more(final)
            if text[paren] != "(" or name.group() not in self.tool_names:
                raise _Invalid
            close = _call_end(text, paren)
            if close is None:
                calls.append(ParsedToolCall(name.group(), ""))
                return _more(final)
            calls.append(ParsedToolCall(name.group(), _arguments(text[i:close])))
            i = _skip_ws(text, close)
            if i >= len(text):
                return _more(final)
            if text[i] == "]":
                return i + 1
            if text[i] != ",":
                raise _Invalid
            i += 1


def _more(final: bool) -> None:
    if final:
        raise _Invalid
    return None


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i


def _call_end(text: str, i: int) -> int | None:
    """Index just past the parenthesis matching text[i] == '(' (Python strings skipped); None when
    it is not written yet."""
    depth = 0
    j = i
    while j < len(text):
        c = text[j]
        if c in "\"'":
            quote = c * 3 if text.startswith(c * 3, j) else c
            j += len(quote)
            while True:
                if j >= len(text):
                    return None
                if text[j] == "\\":
                    j += 2
                    continue
                if text.startswith(quote, j):
                    j += len(quote)
                    break
                j += 1
            continue
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth == 0:
                return j + 1 if c == ")" else _raise()
        j += 1
    return None


def _raise() -> int:
    raise _Invalid


def _arguments(call: str) -> str:
    """`name(a=1, b="x")` -> '{"a": 1, "b": "x"}': keyword arguments with literal values only."""
    try:
        node = ast.parse(call, mode="eval").body
    except SyntaxError:
        raise _Invalid from None
    if not isinstance(node, ast.Call) or node.args or any(k.arg is None for k in node.keywords):
        raise _Invalid
    try:
        args = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
        return json.dumps(args, ensure_ascii=False, allow_nan=False)
    except (ValueError, TypeError, SyntaxError, RecursionError):
        raise _Invalid from None
