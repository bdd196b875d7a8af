"""The text the router matches against its prefix trees, from a request body (already parsed JSON).

It only has to preserve prefix sharing: two requests whose prompts share a prefix once the replica
renders and tokenizes them should share a prefix here. Chat messages are joined in order with
their roles (the chat template renders them in that order; tools come first, as templates put
them in the system prompt); a Responses API request is the chat request it becomes: its tools, its
`instructions` as the system message, then its `input` (a string is one user message; message items
by role and content, other items as their JSON); a completion's prompt is its text (or its token ids
written out); a batch of prompts is routed by its first. A body of an unknown shape routes by the
empty text."""

from __future__ import annotations

import json
from typing import Any


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:
                parts.append(json.dumps(part, sort_keys=True))
        return "".join(parts)
    return "" if content is None else json.dumps(content, sort_keys=True)


def _ids_text(ids: list) -> str:
    return "".join(f"{i}," for i in ids)


def _prompt_text(prompt: Any) -> str:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        if all(isinstance(x, int) for x in prompt):
            return _ids_text(prompt)
        return _prompt_text(prompt[0])  # a batch: its first prompt
    return ""


def routing_text(path: str, body: Any) -> str:
    """The routing text of a request to `path` with JSON `body`."""
    if not isinstance(body, dict):
        return ""
    if path.endswith("/chat/completions"):
        out = [json.dumps(body["tools"], sort_keys=True)] if body.get("tools") else []
        for m in body.get("messages") or []:
            if isinstance(m, dict):
                out.append(f"<|{m.get('role', '')}|>{_content_text(m.get('content'))}")
        return "".join(out)
    if path.endswith("/responses"):
        return _responses_text(body)
    if path.endswith("/completions"):
        return _prompt_text(body.get("prompt"))
    if path.endswith("/generate"):
        if body.get("text") is not None:
            return _prompt_text(body["text"])
        return _prompt_text(body.get("input_ids"))
    return ""


def _responses_text(body: dict) -> str:
    out = [json.dumps(body["tools"], sort_keys=True)] if body.get("tools") else []
    if isinstance(body.get("instructions"), str):
        out.append(f"<|system|>{body['instructions']}")
    items = body.get("input")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    for item in items if isinstance(items, list) else []:
        if isinstance(item, dict) and "role" in item:
            out.append(f"<|{item['role']}|>{_content_text(item.get('content'))}")
        else:  # a function call, its output, reasoning
            out.append(json.dumps(item, sort_keys=True))
    return "".join(out)
