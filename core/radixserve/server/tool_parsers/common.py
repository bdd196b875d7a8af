"""Pieces the built-in tool parsers share: holding back a possible marker, reading one JSON call."""

from __future__ import annotations

import json
from typing import NamedTuple

from radixserve.interfaces.tool_parser import ParsedToolCall
from radixserve.scheduler.stop_strings import stop_prefix_len
from radixserve.server.tool_parsers.json_scan import Malformed, scan_object

ARGUMENT_KEYS = ("arguments", "parameters")  # Hermes/Qwen/Mistral say arguments, Llama parameters


def partial_marker_len(text: str, *markers: str) -> int:
    """Length of the longest tail of `text` that is the start (not the whole) of a marker: that
    much must wait for the next token before it can be shown as content (the rule of stop strings)."""
    return stop_prefix_len(text, markers)


def content_before(text: str, final: bool, *markers: str) -> str:
    """`text` as content, less a tail that may become a marker (unless the output is complete)."""
    return text if final else text[: len(text) - partial_marker_len(text, *markers)]


class CallReading(NamedTuple):
    call: ParsedToolCall | None  # what can be shown so far; None: nothing yet (or not a call)
    end: int | None  # just past the object once it is complete
    ok: bool  # False: this cannot be a valid call (its text is content)


def arguments_text(raw: str) -> str | None:
    """A complete arguments value as a JSON object's text; None when it is not an object."""
    value = json.loads(raw)
    if value is None:
        return "{}"
    if isinstance(value, dict):
        return raw
    if isinstance(value, str):  # some models send the arguments as a JSON-encoded string
        try:
            inner = json.loads(value)
        except ValueError:
            return None
        return value if isinstance(inner, dict) else None
    return None


def read_json_call(text: str, i: int, tool_names: frozenset[str], final: bool) -> CallReading:
    """The call object `{"name": ..., "arguments"|"parameters": {...}}` starting at `text[i]`.

    While the object grows, the call is shown once its name is complete and one of `tool_names`,
    with the arguments' text so far (only when they are an object: other forms are shown complete).
    Complete: the whole object must be valid JSON, its name known, its arguments an object."""
    try:
        scan = scan_object(text, i, final)
    except Malformed:
        return CallReading(None, None, False)
    name_member = scan.get("name")
    args_member = scan.get(*ARGUMENT_KEYS)
    if scan.end is not None:
        try:
            json.loads(text[i : scan.end])
            name = json.loads(text[name_member.start : name_member.end]) if name_member else None
            args = "{}" if args_member is None else arguments_text(text[args_member.start : args_member.end])
        except (ValueError, TypeError):
            return CallReading(None, scan.end, False)
        if not isinstance(name, str) or name not in tool_names or args is None:
            return CallReading(None, scan.end, False)
        return CallReading(ParsedToolCall(name, args), scan.end, True)
    if name_member is None or name_member.end is None:
        return CallReading(None, None, True)
    try:
        name = json.loads(text[name_member.start : name_member.end])
    except ValueError:
        return CallReading(None, None, False)
    if not isinstance(name, str) or name not in tool_names:
        return CallReading(None, None, True)  # decided when the object is complete
    args = ""
    if args_member is not None and text[args_member.start] == "{":
        args = text[args_member.start : args_member.end if args_member.end is not None else len(text)]
    return CallReading(ParsedToolCall(name, args), None, True)
