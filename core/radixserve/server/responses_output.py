"""The Responses API's response object and output items, made from what the chat route answered.

Shapes as OpenAI's API and vLLM write them: a `reasoning` item (`rs_...`) holds the reasoning the
reasoning parser split off in `content` (`reasoning_text` parts; `summary` is empty: no summary is
written), a `message` item (`msg_...`) the answer as one `output_text` part, and one `function_call`
item (`fc_...`) per tool call, its `call_id` chat's call id. The request's settings are echoed, as
the API does. `output_text` is not on the wire: the SDKs compute it from the items."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from radixserve.server.protocol_responses import ResponsesRequest, TextFormatJsonSchema

Item = dict[str, Any]


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def reasoning_item(item_id: str, text: str | None, status: str) -> Item:
    content = [] if text is None else [{"type": "reasoning_text", "text": text}]
    return {"id": item_id, "type": "reasoning", "summary": [], "content": content, "status": status}


def text_part(text: str) -> Item:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(item_id: str, text: str | None, status: str) -> Item:
    content = [] if text is None else [text_part(text)]
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": content}


def function_call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> Item:
    return {"id": item_id, "type": "function_call", "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def outcome(finish_reason: str | None) -> tuple[str, Item | None]:
    """The response's status and incomplete_details for chat's finish reason: "length" (max_output_tokens,
    or the context, ran out) is incomplete, as vLLM reports it; an abort (/abort_request) cancelled."""
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    if finish_reason == "abort":
        return "cancelled", None
    return "completed", None


@dataclass
class ResponseBase:
    """What one response's every state shares: its id, creation time, model and the echoed request."""

    id: str
    model: str
    req: ResponsesRequest
    count_tokens: Callable[[str], int]  # the tokenizer's count of a text (reasoning_tokens)
    created_at: int = field(default_factory=lambda: int(time.time()))

    def response(self, status: str, output: list[Item], usage: Item | None = None,
                 incomplete: Item | None = None, error: Item | None = None) -> Item:
        req = self.req
        fmt = req.text.format if req.text is not None else None
        choice = req.tool_choice
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            # the API's: when it completed, only for status completed (null in progress, incomplete, failed)
            "completed_at": int(time.time()) if status == "completed" else None,
            "error": error, "incomplete_details": incomplete, "model": self.model, "output": output,
            "usage": usage, "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "temperature": 1.0 if req.temperature is None else req.temperature,  # chat's defaults
            "top_p": 1.0 if req.top_p is None else req.top_p,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "tool_choice": "auto" if choice is None else choice if isinstance(choice, str) else choice.model_dump(),
            "tools": [t.model_dump() for t in req.tools or []],
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=isinstance(fmt, TextFormatJsonSchema))
                     if fmt is not None else {"type": "text"}},
            "reasoning": req.reasoning.model_dump(exclude_none=True) if req.reasoning is not None else None,
            "previous_response_id": req.previous_response_id, "store": req.store, "truncation": "disabled",
            "background": False, "metadata": dict(req.metadata or {}), "user": req.user,
        }

    def usage(self, chat_usage: Item | None, reasoning: list[str]) -> Item | None:
        """Chat's usage in the API's names. reasoning_tokens: the reasoning's text counted by the
        tokenizer (the tags around it are not reasoning; retokenizing may differ by a token from the
        generated ids, which the chat answer does not split)."""
        if chat_usage is None:
            return None
        output = int(chat_usage.get("completion_tokens", 0))
        thought = min(output, sum(self.count_tokens(text) for text in reasoning if text))
        cached = int((chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))
        prompt = int(chat_usage.get("prompt_tokens", 0))
        return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached}, "output_tokens": output,
                "output_tokens_details": {"reasoning_tokens": thought}, "total_tokens": prompt + output}

    def from_chat(self, answer: Item) -> Item:
        """The whole response of a (not streamed) chat answer."""
        choice = answer["choices"][0]
        message = choice["message"]
        status, incomplete = outcome(choice.get("finish_reason"))
        reasoning, content = message.get("reasoning_content"), message.get("content")
        calls = message.get("tool_calls") or []
        output: list[Item] = []
        if reasoning:
            output.append(reasoning_item(new_id("rs"), reasoning, "completed"))
        if content or not (output or calls):
            output.append(message_item(new_id("msg"), content or "", "completed"))
        for call in calls:
            fn = call["function"]
            output.append(function_call_item(new_id("fc"), call["id"], fn["name"], fn["arguments"], "completed"))
        if status != "completed":  # what was being written when it stopped
            output[-1]["status"] = "incomplete"
        usage = self.usage(answer.get("usage"), [reasoning or ""])
        return self.response(status, output, usage, incomplete)


def count_tokens(tokenizer: Any) -> Callable[[str], int]:
    """The number of tokens of a text, without the special tokens a prompt would get."""

    def count(text: str) -> int:
        try:
            return len(tokenizer.encode(text, add_special_tokens=False))
        except TypeError:  # a tokenizer (a test's, a plugin's) whose encode takes the text alone
            return len(tokenizer.encode(text))

    return count
