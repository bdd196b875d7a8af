"""Mistral format: `[TOOL_CALLS]` (a special token) then either a JSON array of
`{"name": ..., "arguments": {...}}` objects (tokenizer v3, Mistral-7B-Instruct-v0.3, Mixtral) or
`name[ARGS]{...}` per call, each after its own `[TOOL_CALLS]` (tokenizer v11+). Text before the
first `[TOOL_CALLS]` is content."""

from __future__ import annotations

import re

from radixserve.interfaces.tool_parser import ParsedToolCall, ToolParse, ToolParser
from radixserve.server.tool_parsers.common import (
    arguments_text,
    content_before,
    partial_marker_len,
    read_json_call,
)
from radixserve.server.tool_parsers.json_scan import Malformed, skip_ws, value_end

TAG, ARGS = "[TOOL_CALLS]", "[ARGS]"
_NAME = re.compile(r"[A-Za-z0-9_.-]+")


class _Invalid(Exception):
    pass


class MistralToolParser(ToolParser):
    template_markers = (TAG,)
    needs_special_tokens = True

    def parse(self, text: str, final: bool) -> ToolParse:
        tag = text.find(TAG)
        if tag < 0:
            return ToolParse(content_before(text, final, TAG), ())
        prefix = text[:tag]
        calls: list[ParsedToolCall] = []
        try:
            i = skip_ws(text, tag + len(TAG))
            if i >= len(text):
                raise _Invalid if final else _Incomplete
            if text[i] == "[":
                done = self._json_array(text, i, final, calls)
            else:
                done = self._name_args(text, i, final, calls)
        except _Incomplete:
            return ToolParse(prefix, tuple(calls))
        except _Invalid:
            return ToolParse(text if final else prefix, () if final else tuple(calls))
        if done is None:  # still growing
            return ToolParse(prefix, tuple(calls))
        return ToolParse(prefix + content_before(text[done:], final, TAG), tuple(calls))

    def _json_array(self, text: str, i: int, final: bool, calls: list[ParsedToolCall]) -> int | None:
        """Calls of the array at text[i] == '['; where the array ends (None: not yet)."""
        i = skip_ws(text, i + 1)
        while True:
            if i >= len(text):
                return _more(final)
            if text[i] == "]" and not calls:
                raise _Invalid  # an empty list of calls
            if text[i] != "{":
                raise _Invalid
            reading = read_json_call(text, i, self.tool_names, final)
            if not reading.ok:
                raise _Invalid
            if reading.call is not None:
                calls.append(reading.call)
            if reading.end is None:
                return _more(final)
            i = skip_ws(text, reading.end)
            if i >= len(text):
                return _more(final)
            if text[i] == "]":
                return i + 1
            if text[i] != ",":
                raise _Invalid
            i = skip_ws(text, i + 1)

    def _name_args(self, text: str, i: int, final: bool, calls: list[ParsedToolCall]) -> int | None:
        """Calls written `name[ARGS]{...}`, each after a `[TOOL_CALLS]`; where they end (None: not yet)."""
        while True:
            marker = text.find(ARGS, i)
            if marker < 0:  # the name (or the [ARGS] after it) is still being written
                rest = text[i:]
                rest = rest[: len(rest) - partial_marker_len(rest, ARGS)].strip()
                if not final and (not rest or _NAME.fullmatch(rest)):
                    return None
                raise _Invalid
            name = text[i:marker].strip()
            if not _NAME.fullmatch(name) or name not in self.tool_names:
                raise _Invalid
            start = skip_ws(text, marker + len(ARGS))
            if start >= len(text):
                calls.append(ParsedToolCall(name, ""))
                return _more(final)
            if text[start] != "{":
                raise _Invalid
            try:
                end = value_end(text, start, final)
            except Malformed:
                raise _Invalid from None
            if end is None:
                calls.append(ParsedToolCall(name, text[start:]))
                return _more(final)
            try:
                if arguments_text(text[start:end]) is None:
                    raise _Invalid
            except ValueError:
                raise _Invalid from None
            calls.append(ParsedToolCall(name, text[start:end]))
            nxt = skip_ws(text, end)
            if not text.startswith(TAG, nxt):
                return end
            i = skip_ws(text, nxt + len(TAG))


class _Incomplete(Exception):
    pass


def _more(final: bool) -> None:
    """The calls end before the output does: when the output is complete, they are malformed."""
    if final:
        raise _Invalid
    return None
