"""A refused constraint in the terms the client sent. The sampling check and the runtime name the
constraint `json_schema` (`sampling_params.json_schema`), but on the OpenAI routes it came from
`response_format`, or from a tool's `parameters` under `tool_choice` required / a named function."""

from __future__ import annotations

from typing import Any

from radixserve.server.errors import APIError
from radixserve.server.tool_schema import locate_in_tools

_INVALID = "invalid JSON schema: "  # scheduler/grammar.py's prefix of a schema the backend refuses


def about_json_schema(param: str | None, message: str) -> bool:
    """Whether a 400 is about the request's json_schema constraint (param or the message's field)."""
    return "json_schema" in f"{param} {message.split(' ', 1)[0]}"


def _detail(message: str) -> str:
    """The message without the field the runtime put first ("json_schema: ...")."""
    head, sep, rest = message.partition(": ")
    return rest if sep and " " not in head and head.endswith("json_schema") else message


def response_format_refusal(param: str | None, message: str) -> APIError | None:
    """A json_schema refusal as the `response_format` the constraint came from (None: not one)."""
    if not about_json_schema(param, message):
        return None
    return APIError(f"response_format: {_detail(message)}", 400, "response_format")


def tool_choice_refusal(message: str, tool_choice: str, tools: list[dict[str, Any]], named: int | None) -> APIError:
    """A json_schema refusal under tool_choice required / named. A schema the backend refuses is the
    tool's (`tools.N.function.parameters`, with the backend's locations moved from the constraint's
    wrapper into that tool's parameters); anything else (no backend, one that cannot be built or
    does not compile JSON schemas) is the server's answer to `tool_choice`."""
    what = "tool_choice=required" if tool_choice == "required" else "tool_choice naming a function"
    detail = _detail(message)
    if not detail.startswith(_INVALID):
        return APIError(f"{what} needs a grammar backend to constrain the output, and this server cannot: {detail}",
                        400, "tool_choice")
    index, detail = locate_in_tools(detail.removeprefix(_INVALID), tools, named)
    field = "tools" if index is None else f"tools.{index}.function.parameters"
    whose = "one of the tools' parameters schemas" if index is None else "this parameters schema"
    return APIError(f"{field}: {what} constrains the output to {whose}, and the grammar backend refuses it: {detail}",
                    400, field)
