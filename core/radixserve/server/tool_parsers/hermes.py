"""Hermes / Qwen format: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per
call, text allowed before, between and after the blocks (Qwen2.5, Qwen3, Hermes 2/3, ...)."""

from __future__ import annotations

from radixserve.interfaces.tool_parser import ParsedToolCall, ToolParse, ToolParser
from radixserve.server.tool_parsers.common import content_before, read_json_call
from radixserve.server.tool_parsers.json_scan import skip_ws

START, END = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    template_markers = (START,)

    def parse(self, text: str, final: bool) -> ToolParse:
        content: list[str] = []
        calls: list[ParsedToolCall] = []
        pos = 0
        while True:
            start = text.find(START, pos)
            if start < 0:
                content.append(content_before(text[pos:], final, START))
                break
            content.append(text[pos:start])
            body = skip_ws(text, start + len(START))
            close = text.find(END, body)
            if close < 0:  # the block is still open, or the model stopped inside it
                self._open_block(text, start, body, final, content, calls)
                break
            reading = read_json_call(text[:close], body, self.tool_names, True)
            if reading.ok and reading.call and reading.end is not None and not text[reading.end : close].strip():
                calls.append(reading.call)
            else:  # not a valid call: the model's text stays, markup included
                content.append(text[start : close + len(END)])
            pos = close + len(END)
        return ToolParse("".join(content), tuple(calls))

    def _open_block(
        self, text: str, start: int, body: int, final: bool, content: list[str], calls: list[ParsedToolCall]
    ) -> None:
        if body >= len(text):  # nothing after the tag yet
            if final:
                content.append(text[start:])
            return
        if text[body] != "{":  # can never be a call
            content.append(text[start:])
            return
        reading = read_json_call(text, body, self.tool_names, final)
        if not final:
            if reading.call is not None:
                calls.append(reading.call)
            return
        # complete output without the closing tag (e.g. a stop token right after the JSON)
        if reading.ok and reading.call and reading.end is not None and not text[reading.end :].strip():
            calls.append(reading.call)
        else:
            content.append(text[start:])
