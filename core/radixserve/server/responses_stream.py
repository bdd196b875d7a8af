"""The chat route's SSE chunks as the Responses API's stream events.

Each event is `event: <type>` and `data: {...}` with the type and a `sequence_number` counting from 0,
as OpenAI's API and vLLM send them (no `data: [DONE]` at the end). The order:

    response.created, response.in_progress,
    per output item: response.output_item.added, then
      reasoning: response.content_part.added (reasoning_text), response.reasoning_text.delta...,
                 response.reasoning_text.done, response.content_part.done
      message:   response.content_part.added (output_text), response.output_text.delta...,
                 response.output_text.done, response.content_part.done
      function call: response.function_call_arguments.delta..., response.function_call_arguments.done
    and response.output_item.done once the next item starts (or the output ends),
    response.completed, or response.incomplete when max_output_tokens ended it (an abort too).

An item's parts arrive as chat's deltas do (reasoning, content, each call's id and name first, then its
argument fragments). A chat error event (a failure mid-stream, a shutdown) becomes an `error` event,
with chat's code and the field in the Responses API's terms, then `response.failed` with the output so far."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from radixserve.server.errors import error_body
from radixserve.server.responses_input import ChatInput
from radixserve.server.responses_output import (
    Item,
    ResponseBase,
    function_call_item,
    message_item,
    new_id,
    outcome,
    reasoning_item,
    text_part,
)

logger = logging.getLogger("radixserve.server")


@dataclass
class _Open:
    """The output item being streamed: its position in the output, and the text of its part."""

    index: int
    kind: str  # reasoning | message | function_call
    text: str = ""


class ResponseStream:
    """One response's events, fed chat's chunks (as JSON objects) in order."""

    def __init__(self, base: ResponseBase, chat: ChatInput, on_done: Callable[[Item], None]) -> None:
        self.base, self.chat, self.on_done = base, chat, on_done
        self.seq = 0
        self.output: list[Item] = []
        self.open: _Open | None = None
        self.calls: dict[int, int] = {}  # chat's call index -> its item's position in the output
        self.reasoning: list[str] = []
        self.finish: str | None = None
        self.usage: Item | None = None
        self.ended = False
        self._late_logged = False

    def event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(data)}\n\n"

    def start(self) -> list[str]:
        snapshot = self.base.response("in_progress", [])
        return [self.event("response.created", response=snapshot), self.event("response.in_progress", response=snapshot)]

    def chunk(self, data: Item) -> list[str]:
        if self.ended:
            return []
        if "error" in data:
            return self.fail(data["error"])
        if data.get("usage") and not data.get("choices"):
            self.usage = data["usage"]  # the last chunk (include_usage)
        out: list[str] = []
        for choice in data.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                out += self._text("reasoning", delta["reasoning_content"])
            if delta.get("content"):
                out += self._text("message", delta["content"])
            for call in delta.get("tool_calls") or []:
                out += self._call(call)
            self.finish = choice.get("finish_reason") or self.finish
        return out

    def end(self) -> list[str]:
        """The events after chat's last chunk: the open item done, then the whole response."""
        if self.ended:
            return []
        self.ended = True
        status, incomplete = outcome(self.finish)
        out = self._close("completed" if status == "completed" else "incomplete")
        response = self.base.response(status, self.output, self.base.usage(self.usage, self.reasoning), incomplete)
        self.on_done(response)
        return out + [self.event("response.completed" if status == "completed" else "response.incomplete",
                                 response=response)]

    def fail(self, error: Item) -> list[str]:
        if self.ended:
            return []
        self.ended = True
        message = str(error.get("message", "the response failed"))
        client = self.chat.refusal(_ChatError(message, error.get("param"), error.get("code"), error.get("type")))
        if self.open is not None:  # what was being written stays in the output, cut off (no done events)
            self._finalize(self.open, "incomplete")
            self.open = None
        server_side = error.get("type") != "invalid_request_error"
        failed = self.base.response("failed", self.output, self.base.usage(self.usage, self.reasoning),
                                    error={"code": "server_error" if server_side else "invalid_prompt",
                                           "message": client.message})
        self.on_done(failed)
        return [self.event("error", code=client.code, message=client.message, param=client.param),
                self.event("response.failed", response=failed)]

    # ---- items --------------------------------------------------------------------------------

    def _text(self, kind: str, delta: str) -> list[str]:
        out: list[str] = []
        if self.open is None or self.open.kind != kind:
            out += self._close("completed")
            out += self._start(kind)
        assert self.open is not None
        self.open.text += delta
        where = self._where()
        if kind == "reasoning":
            out.append(self.event("response.reasoning_text.delta", **where, content_index=0, delta=delta))
        else:
            out.append(self.event("response.output_text.delta", **where, content_index=0, delta=delta, logprobs=[]))
        return out

    def _start(self, kind: str) -> list[str]:
        item = reasoning_item(new_id("rs"), None, "in_progress") if kind == "reasoning" else message_item(
            new_id("msg"), None, "in_progress")
        self.output.append(item)
        self.open = _Open(len(self.output) - 1, kind)
        part = {"type": "reasoning_text", "text": ""} if kind == "reasoning" else text_part("")
        return [self.event("response.output_item.added", output_index=self.open.index, item=item),
                self.event("response.content_part.added", **self._where(), content_index=0, part=part)]

    def _call(self, call: Item) -> list[str]:
        fn = call.get("function") or {}
        out: list[str] = []
        if call.get("id"):  # a call's first delta: its id and name
            out += self._close("completed")
            item = function_call_item(new_id("fc"), call["id"], fn.get("name") or "", "", "in_progress")
            self.output.append(item)
            self.open = _Open(len(self.output) - 1, "function_call")
            self.calls[int(call.get("index", 0))] = self.open.index
            out.append(self.event("response.output_item.added", output_index=self.open.index, item=item))
        fragment = fn.get("arguments") or ""
        index = self.calls.get(int(call.get("index", 0)))
        if not fragment or index is None:
            return out
        if self.open is None or self.open.index != index:
            # chat's parser streams a call's arguments before the next call starts; one that did not has
            # its late fragment dropped here (its item is done), logged once
            if not self._late_logged:
                self._late_logged = True
                logger.warning("response %s: arguments of a finished function call arrived late; dropped",
                               self.base.id)
            return out
        self.open.text += fragment
        out.append(self.event("response.function_call_arguments.delta", **self._where(), delta=fragment))
        return out

    def _finalize(self, opened: _Open, status: str) -> Item:
        """The item's final form: its status, and its text or arguments as streamed."""
        item = self.output[opened.index]
        item["status"] = status
        if opened.kind == "function_call":
            item["arguments"] = opened.text
        elif opened.kind == "reasoning":
            self.reasoning.append(opened.text)
            item["content"] = [{"type": "reasoning_text", "text": opened.text}]
        else:
            item["content"] = [text_part(opened.text)]
        return item

    def _close(self, status: str) -> list[str]:
        """The open item's done events, with its final form."""
        if self.open is None:
            return []
        opened, self.open = self.open, None
        item = self._finalize(opened, status)
        where = {"item_id": item["id"], "output_index": opened.index}
        if opened.kind == "function_call":
            out = [self.event("response.function_call_arguments.done", **where, arguments=opened.text)]
        else:
            kind = "reasoning_text" if opened.kind == "reasoning" else "output_text"
            extra = {} if opened.kind == "reasoning" else {"logprobs": []}
            out = [self.event(f"response.{kind}.done", **where, content_index=0, text=opened.text, **extra),
                   self.event("response.content_part.done", **where, content_index=0, part=item["content"][0])]
        return out + [self.event("response.output_item.done", output_index=opened.index, item=item)]

    def _where(self) -> Item:
        assert self.open is not None
        return {"item_id": self.output[self.open.index]["id"], "output_index": self.open.index}


@dataclass
class _ChatError(Exception):
    message: str
    param: str | None
    code: str | None
    type: str | None


async def relay(chat_events: Any, stream: ResponseStream) -> AsyncIterator[str]:
    """The Responses events of chat's SSE body. Closing this generator closes chat's, whose own cleanup
    (abort on disconnect, metrics, the request's log line) then runs as on the chat route."""
    pending = ""
    try:
        for event in stream.start():
            yield event
        async for piece in chat_events:
            pending += piece if isinstance(piece, str) else piece.decode()
            while "\n\n" in pending:
                block, pending = pending.split("\n\n", 1)
                data = block.removeprefix("data: ")
                if data and data != "[DONE]":
                    for event in stream.chunk(json.loads(data)):
                        yield event
        for event in stream.end():
            yield event
    except Exception as e:  # a broken chat event: the client still gets the API's failure events
        logger.exception("response %s failed while streaming", stream.base.id)
        for event in stream.fail(error_body(f"internal error: {e}", 500)["error"]):
            yield event
    finally:
        close = getattr(chat_events, "aclose", None)
        if close is not None:
            await close()
