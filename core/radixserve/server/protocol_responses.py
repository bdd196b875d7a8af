"""Request models of OpenAI's Responses API (`POST /v1/responses`), checked as the chat route's are.

The rules are protocol.py's: unknown fields are a 400 naming them, types are strict, null is the
default and every string must be valid Unicode. What the Responses API has and this server does not
(built-in tools, image and file inputs, `background`, `include`, `truncation: "auto"`, `prompt`,
`conversation`, encrypted reasoning) is a 400 naming the field and saying what is supported, never
ignored. The sampling fields shared with chat (`temperature`, `top_p`, `seed`, the extensions) are
typed here and range-checked by the chat request they become (responses_input.py)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, model_validator

from radixserve.server.protocol import JsonSchemaFormat, _Body, _Request, refuse
from radixserve.server.protocol_tools import FunctionDefinition

ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
_FUNCTION_TOOL = '{"type": "function", "name", "description", "parameters", "strict"}'


def _refuse_other_parts(content: Any, where: str, allowed: tuple[str, ...]) -> None:
    """An image, file or audio part: one error naming it, not pydantic's about every union member."""
    for i, part in enumerate(content if isinstance(content, list) else []):
        kind = part.get("type") if isinstance(part, dict) else None
        if isinstance(kind, str) and kind not in allowed:
            raise refuse(f"{where}.{i}", f"content part type {kind!r} is not supported (text only: {', '.join(allowed)})")


class InputText(_Request):
    type: Literal["input_text"]
    text: str


class OutputText(_Request):
    """An assistant's text, as a response's output gave it (clients send outputs back as input)."""

    type: Literal["output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class RefusalPart(_Request):
    type: Literal["refusal"]
    refusal: str


def _text_or(items: Any) -> Any:
    """A string or a list of `items`, told apart before validating: an error then speaks of the form
    sent, not of both (pydantic's "Input should be a valid string" about a list)."""
    return Annotated[Annotated[str, Tag("text")] | Annotated[items, Tag("list")],
                     Discriminator(lambda v: "text" if isinstance(v, str) else "list")]


ContentPart = Annotated[InputText | OutputText | RefusalPart, Field(discriminator="type")]
Content = _text_or(list[ContentPart])
ItemStatus = Literal["in_progress", "completed", "incomplete"]


class MessageItem(_Request):
    """A message: `{"role", "content"}`, with or without `"type": "message"`; an assistant message of
    an earlier response's output also carries its `id` and `status`."""

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Content
    id: str | None = None
    status: ItemStatus | None = None
    phase: Literal["commentary", "final_answer"] | None = None  # a label of assistant messages; not shown

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data: Any) -> Any:
        if isinstance(data, dict):
            _refuse_other_parts(data.get("content"), "content", ("input_text", "output_text", "refusal"))
        return data

    @model_validator(mode="after")
    def _refusal_is_the_assistants(self) -> MessageItem:
        if self.content == []:
            raise refuse("content", "must not be an empty list of parts")
        if self.role != "assistant" and isinstance(self.content, list):
            for i, part in enumerate(self.content):
                if isinstance(part, RefusalPart):
                    raise refuse(f"content.{i}", "only an assistant message has a refusal part")
        return self


class FunctionCallItem(_Request):
    """A call the model made (an earlier output's `function_call` item)."""

    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str
    arguments: str
    id: str | None = None
    status: ItemStatus | None = None

    @model_validator(mode="before")
    @classmethod
    def _sdk_nulls(cls, data: Any) -> Any:
        # the openai package's `item.model_dump()` writes its other fields as null: what the item was
        if isinstance(data, dict):
            data = {k: v for k, v in data.items() if not (v is None and k in ("namespace", "caller", "async", "async_"))}
        return data


ToolOutput = _text_or(list[InputText])


class FunctionCallOutputItem(_Request):
    """The result of a call, answering its `call_id`."""

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: ToolOutput
    id: str | None = None
    status: ItemStatus | None = None

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data: Any) -> Any:
        if isinstance(data, dict):
            _refuse_other_parts(data.get("output"), "output", ("input_text",))
        return data

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "\n".join(p.text for p in self.output)


class SummaryText(_Request):
    type: Literal["summary_text"]
    text: str


class ReasoningText(_Request):
    type: Literal["reasoning_text"]
    text: str


class ReasoningItem(_Request):
    """An earlier output's reasoning, sent back: its text goes to the template as the assistant's
    `reasoning_content`, as the chat route's does."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[SummaryText] = Field(default_factory=list)
    content: list[ReasoningText] | None = None
    encrypted_content: str | None = None
    status: ItemStatus | None = None

    @model_validator(mode="after")
    def _not_encrypted(self) -> ReasoningItem:
        if self.encrypted_content is not None:  # this server never writes one: nothing could decrypt it
            raise refuse("encrypted_content", "encrypted reasoning is not supported: send the reasoning's content")
        return self

    def text(self) -> str:
        parts = self.content if self.content else self.summary  # vLLM falls back to the summary too
        return "\n".join(p.text for p in parts)


def _item_type(value: Any) -> str | None:
    return value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", None)


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_type),
]
Input = _text_or(list[InputItem])


class FunctionTool(FunctionDefinition):
    """Responses' flat function tool (chat nests the same fields under `function`)."""

    type: Literal["function"]


class FunctionChoice(_Request):
    type: Literal["function"]
    name: str


class TextFormatText(_Request):
    type: Literal["text"]


class TextFormatJsonObject(_Request):
    type: Literal["json_object"]


class TextFormatJsonSchema(JsonSchemaFormat):
    """`text.format` of type json_schema: chat's `response_format.json_schema` fields, flat. Here `schema` is
    required, as in the API (chat's optional schema means any JSON object: audit 37b)."""

    type: Literal["json_schema"]
    schema_: dict[str, Any] | bool = Field(alias="schema")


TextFormat = Annotated[TextFormatText | TextFormatJsonObject | TextFormatJsonSchema, Field(discriminator="type")]


class TextConfig(_Request):
    format: TextFormat | None = None


Effort = Literal["none", "minimal", "low", "medium", "high", "xhigh"]
Summary = Literal["auto", "concise", "detailed"]


class ReasoningConfig(_Request):
    """As vLLM: `effort` goes to the chat template as `reasoning_effort` (a template that reads it, as
    gpt-oss's does, follows it; others render as before); `summary` is accepted and echoed, and a
    reasoning item carries the reasoning itself in `content`, its `summary` empty."""

    effort: Effort | None = None
    summary: Summary | None = None
    generate_summary: Summary | None = None  # the API's deprecated name of summary


class ResponsesRequest(_Body):
    model: str | None = None  # left out: the served model, as on the chat route
    input: Input
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    # the API's limits: 16 pairs, keys of at most 64 characters, values of at most 512 (it is stored with the
    # response: unbounded, one client could fill the store and evict everyone's responses; audit 37b)
    metadata: dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]] | None = Field(
        default=None, max_length=16)
    user: str | None = None
    store: bool = True  # the API's default: kept for GET and previous_response_id
    previous_response_id: str | None = Field(default=None, min_length=1)
    # the API's fields this server has only in their default form (anything else is a 400 saying so)
    background: bool | None = None
    include: list[str] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    prompt: dict[str, Any] | None = None
    conversation: str | dict[str, Any] | None = None
    # the chat route's fields, with its names (vLLM's Responses route takes these too)
    seed: int | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    stop: str | list[str] | None = None
    priority: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _what_is_not_served(cls, data: Any) -> Any:
        """Built-in tools, other item types and tool choices: a 400 saying what is supported, before
        pydantic's errors about every member of the unions."""
        if not isinstance(data, dict):
            return data
        for i, tool in enumerate(data.get("tools") if isinstance(data.get("tools"), list) else []):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if isinstance(kind, str) and kind != "function":
                raise refuse(f"tools.{i}.type", f"built-in tool {kind!r} is not supported: only function tools "
                                                f"({_FUNCTION_TOOL})")
            if isinstance(tool, dict) and "function" in tool and "name" not in tool:
                raise refuse(f"tools.{i}", f"Responses function tools are flat, {_FUNCTION_TOOL}, not chat's "
                                           '{"type": "function", "function": {...}}')
        for i, item in enumerate(data.get("input") if isinstance(data.get("input"), list) else []):
            kind = _item_type(item)
            if isinstance(item, dict) and isinstance(kind, str) and kind not in ITEM_TYPES:
                hint = " (send the item itself, or previous_response_id)" if kind == "item_reference" else ""
                raise refuse(f"input.{i}.type", f"input item type {kind!r} is not supported{hint}; supported: "
                                                f"{', '.join(ITEM_TYPES)}")
        choice = data.get("tool_choice")
        if isinstance(choice, dict) and choice.get("type") != "function":
            raise refuse("tool_choice", f"tool_choice of type {choice.get('type')!r} is not supported; supported: "
                                        '"auto", "none", "required", {"type": "function", "name": ...}')
        return data

    @model_validator(mode="after")
    def _defaults_only(self) -> ResponsesRequest:
        if self.background:
            raise refuse("background", "background responses are not supported: send the request without it "
                                       "(stream=true to follow a long one)")
        if self.include:
            raise refuse("include", f"{self.include[0]!r} cannot be included: this server adds nothing to the "
                                    "output on request (include must be empty)")
        if self.truncation == "auto":
            raise refuse("truncation", 'truncation "auto" is not supported: a conversation over the context is a '
                                       '400 ("disabled", the default)')
        if self.prompt is not None:
            raise refuse("prompt", "prompt templates are not supported: send input and instructions")
        if self.conversation is not None:
            raise refuse("conversation", "conversations are not supported: use previous_response_id")
        if not self.input and self.previous_response_id is None:  # "" or []: no prompt at all, as chat's messages
            raise refuse("input", "must not be empty: send the user's message, or previous_response_id to continue "
                                  "a stored response")
        return self

    def items(self) -> list[Any]:
        """The input as items: a string is one user message."""
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        return list(self.input)
