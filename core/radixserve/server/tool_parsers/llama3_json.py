"""Llama 3.x JSON format: the output is `{"name": ..., "parameters": {...}}` (several separated by
`;`), optionally after the `<|python_tag|>` special token, which may follow some text."""

from __future__ import annotations

from radixserve.interfaces.tool_parser import ParsedToolCall, ToolParse, ToolParser
from radixserve.server.tool_parsers.common import content_before, read_json_call
from radixserve.server.tool_parsers.json_scan import skip_ws

TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    template_markers = ('"parameters": ',)
    needs_special_tokens = True  # <|python_tag|> is a special token

    @classmethod
    def matches_template(cls, template: str) -> bool:
        return '"parameters": ' in template and "<|start_header_id|>" in template

    def parse(self, text: str, final: bool) -> ToolParse:
        tag = text.find(TAG)
        if tag >= 0:
            prefix, region = text[:tag], tag + len(TAG)
        else:
            first = skip_ws(text, 0)
            if first >= len(text):  # only whitespace so far: could still become a call
                return ToolParse(text if final else "", ())
            if text[first] != "{":
                return ToolParse(content_before(text, final, TAG), ())
            prefix, region = "", first
        calls: list[ParsedToolCall] = []
        i = region
        while True:
            i = skip_ws(text, i)
            if i >= len(text):
                if final and not calls:  # a tag with nothing after it
                    return ToolParse(text, ())
                return ToolParse(prefix, tuple(calls))
            if text[i] != "{":
                if not calls:  # e.g. <|python_tag|> followed by code: not a JSON call
                    return ToolParse(text if final else prefix, ())
                return ToolParse(prefix + content_before(text[i:], final, TAG), tuple(calls))
            reading = read_json_call(text, i, self.tool_names, final)
            if not reading.ok or (final and reading.end is None):
                return ToolParse(text if final else prefix, () if final else tuple(calls))
            if reading.call is not None:
                calls.append(reading.call)
            if reading.end is None:
                return ToolParse(prefix, tuple(calls))
            i = skip_ws(text, reading.end)
            if i < len(text) and text[i] in ";,":
                i += 1
