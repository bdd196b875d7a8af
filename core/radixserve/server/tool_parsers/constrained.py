"""Parsers of the output that the grammar constrains under `tool_choice="required"` (a JSON array
of `{"name", "arguments"}`) or a named function (the arguments object alone). The grammar
guarantees the shape, so the output is never content: one cut short by max_tokens is the calls
written so far, the last with its arguments as far as they go (see `radixserve.server.chat_output`)."""

from __future__ import annotations

import json

from radixserve.interfaces.tool_parser import ParsedToolCall, ToolParse, ToolParser
from radixserve.server.tool_parsers.common import read_json_call
from radixserve.server.tool_parsers.json_scan import Malformed, skip_ws, value_end


class RequiredCallsParser(ToolParser):
    """`[{"name": "f", "arguments": {...}}, ...]`."""

    constrained = True  # the grammar shapes the whole output as calls

    def parse(self, text: str, final: bool) -> ToolParse:
        calls: list[ParsedToolCall] = []
        i = skip_ws(text, 0)
        if i >= len(text) or text[i] != "[":
            return ToolParse(text if final else "", ())
        i = skip_ws(text, i + 1)
        while i < len(text):
            if text[i] != "{":
                return ToolParse(text, ()) if final else ToolParse("", tuple(calls))
            reading = read_json_call(text, i, self.tool_names, final)
            if reading.call is not None:
                calls.append(reading.call)
            if not reading.ok or reading.end is None:
                break
            i = skip_ws(text, reading.end)
            if i < len(text) and text[i] == "]":
                return ToolParse("", tuple(calls)) if calls else ToolParse(text if final else "", ())
            if i < len(text) and text[i] == ",":
                i = skip_ws(text, i + 1)
            elif i < len(text):
                break
        return ToolParse(text, ()) if final else ToolParse("", tuple(calls))


class NamedCallParser(ToolParser):
    """The arguments object of the one function the request named."""

    constrained = True

    def __init__(self, tool_names) -> None:
        super().__init__(tool_names)
        (self.name,) = self.tool_names

    def parse(self, text: str, final: bool) -> ToolParse:
        i = skip_ws(text, 0)
        if i >= len(text) or text[i] != "{":
            return ToolParse(text if final else "", ())
        try:
            end = value_end(text, i, final)
        except Malformed:
            end = None
        if not final:
            return ToolParse("", (ParsedToolCall(self.name, text[i:end] if end else text[i:]),))
        if end is None or text[end:].strip():
            return ToolParse(text, ())
        try:
            ok = isinstance(json.loads(text[i:end]), dict)
        except ValueError:
            ok = False
        return ToolParse("", (ParsedToolCall(self.name, text[i:end]),)) if ok else ToolParse(text, ())
