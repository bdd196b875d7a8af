"""Request and response models of tool calling and reasoning on /v1/chat/completions (OpenAI's
shapes; `separate_reasoning` and `chat_template_kwargs` are SGLang/vLLM extensions).

A bad tool definition is a 400 naming the field (`tools.0.function.parameters: ...`)."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer

from radixserve.server.tool_schema import check_parameters_schema


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Request(_Strict):
    """Request-only models: strict types, as protocol.py's requests (`"true"` is no boolean)."""

    model_config = ConfigDict(extra="forbid", strict=True)


FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


class FunctionDefinition(_Request):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of an object; None: no arguments
    strict: bool | None = None

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not FUNCTION_NAME.match(v):
            raise ValueError(f"function names are 1-64 characters of a-z, A-Z, 0-9, _ . -; got {v!r}")
        return v

    @field_validator("parameters")
    @classmethod
    def _parameters(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is not None:
            check_parameters_schema(v)
        return v


class ToolDefinition(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(_Strict):
    name: str
    arguments: str  # JSON text of an object


class ToolCall(_Strict):
    """A call in a response, or in an assistant message of the history."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatToolFields(_Request):
    """The chat request's fields for tools and reasoning (mixed into ChatCompletionRequest)."""

    # [] is no tools (OpenAI refuses it; vLLM and SGLang take it, and clients written against them send it)
    tools: list[ToolDefinition] | None = Field(default=None, max_length=128)
    tool_choice: ToolChoice | None = None  # default: "auto" with tools, "none" without
    parallel_tool_calls: bool | None = None  # default true; false: at most one call
    separate_reasoning: bool = True  # false: the reasoning stays in `content`
    chat_template_kwargs: dict[str, Any] | None = None  # e.g. {"enable_thinking": false} (Qwen3)

    @field_validator("tools")
    @classmethod
    def _unique(cls, v: list[ToolDefinition] | None) -> list[ToolDefinition] | None:
        names = [t.function.name for t in v or []]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"function names must be unique; {dup[0]!r} is given more than once")
        return v


def _omit_none(d: dict) -> dict:
    return {k: v for k, v in d.items() if v is not None}


class DeltaFunctionCall(_Strict):
    name: str | None = None
    arguments: str | None = None

    @model_serializer(mode="wrap")
    def _omit(self, handler):
        return _omit_none(handler(self))


class DeltaToolCall(_Strict):
    """One streamed piece of a call: the first carries id, type and the name (arguments ""), the
    next ones argument fragments; `index` says which call (OpenAI's client joins them by it)."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall

    @model_serializer(mode="wrap")
    def _omit(self, handler):
        return _omit_none(handler(self))
