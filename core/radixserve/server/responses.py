"""OpenAI's Responses API: `POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`.

A request is translated into the chat request `/v1/chat/completions` would get (responses_input.py)
and run by the chat route's own handler, `Serving.chat`: the template, tool and reasoning parsers,
structured output, validation, metrics (counted under route `chat`), abort on disconnect and shutdown
are chat's. Its answer, or its stream of chunks, is translated back (responses_output.py,
responses_stream.py).

`store` (true unless the request says false) keeps the finished response in `ResponseStore`, in this
process's memory: `GET` returns it, `previous_response_id` continues its conversation (the stored
conversation, its output, then the new input), `DELETE` forgets it."""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import TypeAdapter

from radixserve.server.errors import APIError
from radixserve.server.protocol_responses import InputItem, ResponsesRequest
from radixserve.server.responses_input import PREVIOUS, dump_item, to_chat
from radixserve.server.responses_output import Item, ResponseBase, count_tokens, new_id
from radixserve.server.responses_stream import ResponseStream, relay
from radixserve.server.runtime_api import RequestError

MAX_STORED_RESPONSES = 1024
MAX_STORED_BYTES = 256 * 1024 * 1024  # of JSON, the responses and their conversations together
_ITEMS = TypeAdapter(list[InputItem])


@dataclass
class Stored:
    response: Item
    conversation: list[Item]  # the items before its output: earlier turns and its input (instructions aside)
    size: int


class ResponseStore:
    """Finished responses by id, least recently used evicted first: at most `max_responses`, and at
    most `max_bytes` of their JSON (a response keeps a copy of its whole conversation). In memory:
    lost on restart, and not shared between processes (each `--dp` replica has its own)."""

    def __init__(self, max_responses: int = MAX_STORED_RESPONSES, max_bytes: int = MAX_STORED_BYTES) -> None:
        self.max_responses, self.max_bytes = max_responses, max_bytes
        self._entries: OrderedDict[str, Stored] = OrderedDict()
        self._bytes = 0

    def put(self, response: Item, conversation: list[Item]) -> None:
        size = len(json.dumps(response)) + len(json.dumps(conversation))
        self.delete(response["id"])
        self._entries[response["id"]] = Stored(response, conversation, size)
        self._bytes += size
        while len(self._entries) > self.max_responses or (self._bytes > self.max_bytes and len(self._entries) > 1):
            _, old = self._entries.popitem(last=False)
            self._bytes -= old.size

    def get(self, response_id: str) -> Stored | None:
        stored = self._entries.get(response_id)
        if stored is not None:
            self._entries.move_to_end(response_id)
        return stored

    def delete(self, response_id: str) -> bool:
        stored = self._entries.pop(response_id, None)
        if stored is not None:
            self._bytes -= stored.size
        return stored is not None

    def __len__(self) -> int:
        return len(self._entries)


def response_not_found(response_id: str, param: str | None = None) -> APIError:
    return APIError(f"no response with id {response_id!r} is stored on this server (a response is stored once it "
                    f"has finished, unless it was sent with store false; stored responses are kept in memory, up to "
                    f"{MAX_STORED_RESPONSES}, and lost on restart)", 404, param, type="invalid_request_error")


def add_responses_routes(app: FastAPI, serving: Any, store: ResponseStore | None = None) -> ResponseStore:
    store = store if store is not None else ResponseStore()
    count = count_tokens(serving.tm.tokenizer)

    @app.post("/v1/responses")
    async def create_response(body: ResponsesRequest, request: Request) -> Response:
        serving.check_ready(body.model)
        conversation: list[tuple[str, Any]] = []
        if body.previous_response_id is not None:
            stored = store.get(body.previous_response_id)
            if stored is None:
                raise response_not_found(body.previous_response_id, PREVIOUS)
            conversation = [(PREVIOUS, item) for item in
                            _ITEMS.validate_python(stored.conversation + stored.response["output"])]
        text = isinstance(body.input, str)
        conversation += [("input" if text else f"input.{i}", item) for i, item in enumerate(body.items())]
        base = ResponseBase(new_id("resp"), serving.tm.model_name, body, count)
        chat = to_chat(body, conversation, base.id)
        try:
            answer = await serving.chat(chat.request(), request)
        except (APIError, RequestError) as e:
            raise chat.refusal(e) from None
        kept = [dump_item(item) for _, item in conversation] if body.store else []

        def keep(response: Item) -> None:
            if body.store:
                store.put(response, kept)

        if isinstance(answer, StreamingResponse):
            headers = {k: v for k, v in answer.headers.items() if k in ("cache-control", "x-accel-buffering")}
            stream = ResponseStream(base, chat, keep)
            return StreamingResponse(relay(answer.body_iterator, stream), media_type="text/event-stream",
                                     headers=headers)
        response = base.from_chat(json.loads(bytes(answer.body)))
        keep(response)
        return JSONResponse(response)

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str, request: Request) -> JSONResponse:
        for name in request.query_params:  # the SDK's retrieve(stream=True) got JSON and yielded nothing (audit 37b)
            raise APIError(f"{name}: retrieving a stored response takes no parameters here (no stream replay, no "
                           "include); GET the response as it was stored", 400, name)
        stored = store.get(response_id)
        if stored is None:
            raise response_not_found(response_id)
        return JSONResponse(stored.response)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> JSONResponse:
        if not store.delete(response_id):
            raise response_not_found(response_id)
        return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})

    return store
