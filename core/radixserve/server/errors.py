"""OpenAI-shaped errors: every failure leaves the server as
{"error": {"message", "type", "param", "code"}} with a fitting HTTP status.

`APIError` is raised by handlers; `install_error_handlers(app)` maps it, pydantic validation
errors, bad JSON, unknown routes and unexpected exceptions to that shape."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from http import HTTPStatus
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

if TYPE_CHECKING:
    from radixserve.validation import InvalidRequest

logger = logging.getLogger(__name__)

# OpenAI's `type` strings per status; clients (and the openai package) key their exceptions on status.
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable_error",
}


@dataclass
class APIError(Exception):
    """A request failure the client should see; `status` is the HTTP status."""

    message: str
    status: int = 400
    param: str | None = None
    code: str | None = None
    type: str | None = None  # None: the status's type (_TYPES)

    def __str__(self) -> str:
        return self.message


# OpenAI's `code` for these statuses wherever a caller names none: one code per outcome, so a client that
# retries on "service_unavailable" sees it for a refused request and for one ended in flight alike
_CODES = {401: "invalid_api_key", 503: "service_unavailable"}


def _encodable(text: str) -> str:
    """Text that JSON-encodes as UTF-8: a lone surrogate a client sent (valid JSON, `"\\ud800"`)
    quoted back in a message would make the error response itself fail."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_body(message: str, status: int, param: str | None = None, code: str | None = None,
               type_: str | None = None) -> dict[str, Any]:
    if type_ is None:
        type_ = _TYPES.get(status, "invalid_request_error" if status < 500 else "internal_server_error")
    return {
        "error": {
            "message": _encodable(message),
            "type": type_,
            "param": None if param is None else _encodable(param),
            "code": code if code is not None else _CODES.get(status, str(status)),
        }
    }


def error_response(message: str, status: int, param: str | None = None, code: str | None = None,
                   type_: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, status, param, code, type_), status_code=status)


def refused(e: InvalidRequest) -> APIError:
    """A request validation.py refused, as the HTTP 400 it is (its `param` and named `code` kept)."""
    return APIError(e.message, 400, e.param, e.code)


def model_not_found(message: str) -> APIError:
    """An unknown `model`: a 404 of OpenAI's shape for it (type invalid_request_error, not the
    not_found_error of an unknown route)."""
    return APIError(message, 404, "model", "model_not_found", "invalid_request_error")


_PYDANTIC_PREFIXES = ("Value error, ", "Assertion failed, ")

# request fields of vLLM's and SGLang's OpenAI routes: refused (unknown fields are), with the spelling that
# works here, or None where nothing does
_PEER_FIELDS: dict[str, str | None] = {
    "guided_json": 'response_format {"type": "json_schema", ...} (or /generate\'s sampling_params.json_schema)',
    "guided_regex": "/generate's sampling_params.regex",
    "guided_grammar": "/generate's sampling_params.ebnf",
    "guided_choice": "/generate's sampling_params.regex with the choices as alternatives, (a|b)",
    "guided_decoding_backend": "the server's stack.grammar",
    "regex": "/generate's sampling_params.regex",
    "ebnf": "/generate's sampling_params.ebnf",
    "json_schema": 'response_format {"type": "json_schema", ...}',
    "structured_outputs": 'response_format {"type": "json_schema", ...} (or /generate\'s sampling_params.regex / '
                          "ebnf / json_schema)",
    "request_id": "/generate's rid (the OpenAI routes make their own ids)",
    "add_special_tokens": "a prompt of token ids on /v1/completions (/tokenize takes add_special_tokens)",
    "use_beam_search": None,
    "continue_final_message": None,
    "truncate_prompt_tokens": None,
    # vLLM's other sampling and output extensions (audit 34): none has an equivalent
    "spaces_between_special_tokens": None,  # the text is the tokenizer's own decode of the ids
    "echo": None,  # on chat (/v1/completions takes echo)
    "best_of": None,  # on chat (/v1/completions takes best_of equal to n)
    "bad_words": None,
    "allowed_token_ids": None,
    "return_tokens_as_token_ids": None,
    "length_penalty": None,
    "typical_p": None,
    "guided_whitespace_pattern": None,
    "cache_salt": None,
    "vllm_xargs": None,
}


def _client_loc(loc: list[Any], body: Any, missing: bool) -> list[str]:
    """The error's location as the client spelled it. Pydantic puts the union member it tried into
    the location (`stop.str`, `messages.0.content.list[TextPart]`): a part that is not in the body
    is such a tag, except the last one of a missing field."""
    if body is None:
        return [str(x) for x in loc]
    out: list[str] = []
    node = body
    for i, part in enumerate(loc):
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            node = node[part]
        elif not (missing and i == len(loc) - 1):
            continue
        out.append(str(part))
    return out


def _join(messages: list[str]) -> str:
    """Messages about one field (one per union member): "Input should be a valid string or a valid list"."""
    head, *rest = messages
    same = "Input should be "
    return " or ".join([head] + [m.removeprefix(same) if head.startswith(same) else m for m in rest])


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """One readable line naming the bad fields, and the first bad field as `param`."""
    body = getattr(exc, "body", None)
    by_field: dict[str, list[str]] = {}
    for err in exc.errors():
        if err.get("type") == "json_invalid":
            what = str(err.get("ctx", {}).get("error", err.get("msg")))
            where = list(err.get("loc", ()))[1:2]  # FastAPI keeps the position here, cut from the message
            if where and isinstance(where[0], int):  # "... starting at" -> "... starting at character 25"
                what += f" character {where[0]}" if what.endswith(" at") else f" (at character {where[0]})"
            return f"request body is not valid JSON: {what}", None
        loc = list(err.get("loc", ()))
        loc = loc[1:] if loc[:1] == ["body"] else loc
        where = ".".join(_client_loc(loc, body, err.get("type") == "missing"))
        ctx = err.get("ctx") or {}
        if "param" in ctx:  # protocol.refuse: a check naming its field, relative to its model
            where = f"{where}.{ctx['param']}" if where else str(ctx["param"])
        msg = str(err.get("msg", ""))
        for prefix in _PYDANTIC_PREFIXES:
            msg = msg.removeprefix(prefix)
        if err.get("type") == "extra_forbidden" and loc and loc[-1] in _PEER_FIELDS:
            same = _PEER_FIELDS[loc[-1]]
            msg += (f" (vLLM's / SGLang's {loc[-1]} is {same} here)" if same is not None
                    else f" (vLLM's / SGLang's {loc[-1]} has no equivalent here)")
        if msg not in by_field.setdefault(where, []):
            by_field[where].append(msg)
    parts = []
    for where, messages in by_field.items():
        text = _join(messages)
        parts.append(text if where and text.startswith(where) else f"{where or 'request body'}: {text}")
    param = next((w for w in by_field if w), None)
    return "; ".join(parts), param


def _unparsed_body_message(cause: BaseException | None) -> str | None:
    """Why FastAPI could not parse a body it reports only as "There was an error parsing the body"
    (anything but a JSON syntax error: bytes that are not UTF-8, nesting past Python's recursion limit)."""
    if isinstance(cause, UnicodeDecodeError):
        return f"request body is not valid JSON: it is not UTF-8 (byte 0x{cause.object[cause.start]:02x} at position {cause.start})"
    if isinstance(cause, RecursionError):
        return "request body is not valid JSON: it is nested too deeply"
    return None


def _not_json_content_type(request: Request, exc: RequestValidationError) -> str | None:
    """FastAPI parses a body as JSON only under a JSON Content-Type (newer FastAPI: not without one
    either, against cross-site form posts); otherwise the route sees raw bytes, and pydantic's message
    says nothing about the header that caused it."""
    if not isinstance(getattr(exc, "body", None), (bytes, bytearray)):
        return None
    content_type = request.headers.get("content-type")
    sent = f"Content-Type {content_type!r} is not JSON" if content_type else "the request has no Content-Type"
    return f"{sent}: send the body with Content-Type: application/json"


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.message, exc.status, exc.param, exc.code, exc.type)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        header_problem = _not_json_content_type(request, exc)
        if header_problem is not None:
            return error_response(header_problem, HTTPStatus.BAD_REQUEST)
        message, param = _validation_message(exc)
        return error_response(message, HTTPStatus.BAD_REQUEST, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        detail = exc.detail if isinstance(exc.detail, str) else HTTPStatus(exc.status_code).phrase
        if exc.status_code == HTTPStatus.BAD_REQUEST:
            detail = _unparsed_body_message(exc.__cause__) or detail
        return error_response(detail, exc.status_code)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error while serving a request")
        return error_response(f"internal error: {type(exc).__name__}: {exc}", HTTPStatus.INTERNAL_SERVER_ERROR)
