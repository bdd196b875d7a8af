"""A Responses request as the chat request `/v1/chat/completions` would get: the items become chat
messages, the settings chat's fields. The chat route then renders, checks and runs it, so every rule
of chat (template, tools, parsers, structured output, validation) is the Responses route's too.

Items become messages as vLLM builds them: `instructions` is a system message first; an assistant
message, the reasoning and the function calls that follow one another are one assistant turn
(`content`, `reasoning_content`, `tool_calls`); a `function_call_output` is a tool message. A refusal
from chat names chat's field; `ChatInput.refusal` names the field of the Responses request instead
(`messages.3.content` -> `input.2.content`, `max_tokens` -> `max_output_tokens`)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from radixserve.server import protocol as p
from radixserve.server.errors import APIError, _validation_message
from radixserve.server.protocol_responses import (
    FunctionCallItem,
    FunctionCallOutputItem,
    MessageItem,
    ReasoningItem,
    RefusalPart,
    ResponsesRequest,
    TextFormatJsonSchema,
)

PREVIOUS = "previous_response_id"  # where the items of a stored conversation came from
# chat's spelling -> the Responses API's, in parameters and messages
_RENAMED = ((re.compile(r"\bmax_(?:completion_)?tokens\b"), "max_output_tokens"),
            (re.compile(r"\bresponse_format(?:\.json_schema)?\b"), "text.format"),
            (re.compile(r"\btools\.(\d+)\.function\b"), r"tools.\1"))
# request fields that chat takes under the same name
_SAME = ("model", "temperature", "top_p", "seed", "top_k", "min_p", "repetition_penalty", "frequency_penalty",
         "presence_penalty", "stop", "priority", "parallel_tool_calls", "user")


@dataclass
class Source:
    """Where a chat message came from: `path` (`instructions`, `input.3`, previous_response_id) and,
    for an assistant turn, the item of each of its tool calls."""

    path: str
    calls: list[str] = field(default_factory=list)


@dataclass
class ChatInput:
    body: dict[str, Any]  # the chat request, as JSON
    sources: list[Source]  # one per chat message

    def request(self) -> p.ChatCompletionRequest:
        """The chat request; a 400 naming the Responses field where chat's checks refuse it."""
        try:
            return p.ChatCompletionRequest.model_validate(self.body)
        except ValidationError as e:
            message, param = _validation_message(RequestValidationError(e.errors(), body=self.body))
            raise self.refusal(APIError(message, 400, param)) from None

    def refusal(self, e: Exception) -> APIError:
        """A refusal of the chat request (APIError, or the runtime's RequestError) as the client's."""
        status = int(getattr(e, "status", 400))
        message = str(getattr(e, "message", e))
        param = getattr(e, "param", None)
        new = self.client_param(param)
        if param and new == PREVIOUS and param.startswith("messages"):  # no field of this request to name
            message = f"previous_response_id: an item of the stored conversation is refused ({message})"
        elif param and new and new != param:
            message = message.replace(param, new)
        return APIError(_respelled(message), status, new, getattr(e, "code", None), getattr(e, "type", None))

    def client_param(self, param: str | None) -> str | None:
        if param is None:
            return None
        if param == "messages":  # the whole conversation (it does not fit the context)
            return "input"
        m = re.match(r"messages\.(\d+)(.*)", param)
        if m is None:
            return _respelled(param)
        index, rest = int(m[1]), m[2]
        if index >= len(self.sources):
            return "input"
        source = self.sources[index]
        if source.path in (PREVIOUS, "instructions"):
            return source.path
        call = re.match(r"\.tool_calls\.(\d+)(?:\.function)?(.*)", rest)
        if call and int(call[1]) < len(source.calls):
            return source.calls[int(call[1])] + call[2]
        if rest.startswith(".tool_call_id"):
            return f"{source.path}.call_id"
        return source.path + (rest if rest.startswith(".content") else "")


def _respelled(text: str) -> str:
    for pattern, new in _RENAMED:
        text = pattern.sub(new, text)
    return text


def to_chat(req: ResponsesRequest, items: list[tuple[str, Any]], rid: str) -> ChatInput:
    """The chat request of `req`, its conversation `items` ((path, item): a stored conversation's
    first, then the request's input)."""
    messages: list[dict[str, Any]] = []
    sources: list[Source] = []
    if req.instructions:  # as the API: a new request's instructions only (a stored turn's are not kept)
        messages.append({"role": "system", "content": req.instructions})
        sources.append(Source("instructions"))
    turn: dict[str, Any] | None = None  # the assistant turn being assembled
    calls: dict[str, str] = {}  # call_id -> the path of its function_call item

    def open_turn(path: str) -> dict[str, Any]:
        messages.append({"role": "assistant", "content": None})
        sources.append(Source(path))
        return messages[-1]

    for path, item in items:
        if isinstance(item, MessageItem) and item.role != "assistant":
            turn = None
            messages.append({"role": item.role, "content": _content(item)})
            sources.append(Source(path))
        elif isinstance(item, MessageItem):
            if turn is None or turn["content"] is not None or "tool_calls" in turn:
                turn = open_turn(path)
            turn["content"] = _content(item)
            refusals = [part.refusal for part in item.content if isinstance(part, RefusalPart)] if isinstance(
                item.content, list) else []
            if refusals:  # accepted and not shown, as chat takes an assistant message's refusal
                turn["refusal"] = "\n".join(refusals)
        elif isinstance(item, ReasoningItem):
            if turn is None or turn["content"] is not None or "tool_calls" in turn or "reasoning_content" in turn:
                turn = open_turn(path)
            turn["reasoning_content"] = item.text()
        elif isinstance(item, FunctionCallItem):
            _check_call(calls, item, path)
            if turn is None:
                turn = open_turn(path)
            turn.setdefault("tool_calls", []).append(
                {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}})
            sources[-1].calls.append(path)
        elif isinstance(item, FunctionCallOutputItem):
            turn = None
            _check_answers(messages, calls, item, path)
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
            sources.append(Source(path))
    for m in messages:  # a turn of reasoning alone (cut off by max_output_tokens) still has content
        if m["role"] == "assistant" and m["content"] is None and not m.get("tool_calls") and "refusal" not in m:
            m["content"] = ""
    if not messages:
        raise APIError("input: must not be empty", 400, "input")
    return ChatInput(_settings(req, messages, rid), sources)


def _content(item: MessageItem) -> str | list[dict[str, str]]:
    """A message's text as chat's content: a string, or its text parts (chat joins them, or hands a
    template that reads the parts the list)."""
    if isinstance(item.content, str):
        return item.content
    parts = [{"type": "text", "text": part.text} for part in item.content if not isinstance(part, RefusalPart)]
    return parts or ""


def _param(path: str) -> str:
    """The field of an item's call_id: the item's, or previous_response_id for a stored one."""
    return PREVIOUS if path == PREVIOUS else f"{path}.call_id"


def _made_by(path: str) -> str:
    return "a function_call of previous_response_id" if path == PREVIOUS else path


def _check_call(calls: dict[str, str], item: FunctionCallItem, path: str) -> None:
    """A call_id names one call of the conversation (its input and the previous_response_id chain), as
    OpenAI's: with two, an output would answer either."""
    first = calls.get(item.call_id)
    calls[item.call_id] = path
    if first is not None:
        param = _param(path)
        raise APIError(f"{param}: {item.call_id!r} is the call_id of {_made_by(first)} too: each function_call "
                       "has its own call_id (send a call once, or its earlier response's id as previous_response_id "
                       "without the call itself)", 400, param)


def _check_answers(messages: list[dict[str, Any]], calls: dict[str, str], item: FunctionCallOutputItem,
                   path: str) -> None:
    """An output answers a call of the conversation (OpenAI's 400 "No tool call found for function call
    output"), and, as chat checks its tool messages, one of the turn right before it."""
    before = next((m for m in reversed(messages) if m["role"] != "tool"), None)
    ids = [c["id"] for c in (before or {}).get("tool_calls") or []]
    if item.call_id in ids:
        return
    param = _param(path)
    right_before = (f"the calls right before it are {', '.join(map(repr, ids))}" if ids else
                    "no function_call item is right before it")
    if item.call_id not in calls:
        message = (f"{param}: No tool call found for function call output with call_id {item.call_id!r} (no "
                   f"function_call item of the conversation has it; {right_before}): send the function_call items, "
                   "then their outputs, or continue the response that made them with previous_response_id")
    else:
        message = (f"{param}: {item.call_id!r} answers no function_call item right before it (its call is "
                   f"{_made_by(calls[item.call_id])}; {right_before}): a call's output follows the function_call "
                   "items of its turn, before the next message")
    raise APIError(message, 400, param)


def _settings(req: ResponsesRequest, messages: list[dict[str, Any]], rid: str) -> dict[str, Any]:
    body: dict[str, Any] = {"messages": messages, "stream": req.stream, "rid": rid}
    if req.stream:
        body["stream_options"] = {"include_usage": True}  # the final usage, for response.completed
    if req.max_output_tokens is not None:
        body["max_tokens"] = req.max_output_tokens
    for name in _SAME:
        value = getattr(req, name)
        if value is not None:
            body[name] = value
    if req.tools is not None:
        body["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                         for t in req.tools]
    choice = req.tool_choice
    if choice is not None:
        body["tool_choice"] = choice if isinstance(choice, str) else {"type": "function",
                                                                       "function": {"name": choice.name}}
    fmt = req.text.format if req.text is not None else None
    if isinstance(fmt, TextFormatJsonSchema):
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": fmt.model_dump(by_alias=True, exclude={"type"}, exclude_none=True)}
    elif fmt is not None:
        body["response_format"] = {"type": fmt.type}
    kwargs = dict(req.chat_template_kwargs or {})
    if req.reasoning is not None and req.reasoning.effort is not None:
        kwargs.setdefault("reasoning_effort", req.reasoning.effort)  # vLLM's: the template decides
    if kwargs:
        body["chat_template_kwargs"] = kwargs
    return body


def dump_item(item: Any) -> dict[str, Any]:
    """An item as stored (JSON), for a later request's previous_response_id."""
    return item.model_dump(by_alias=True, exclude_none=True)

