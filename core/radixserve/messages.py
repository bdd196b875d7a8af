"""Typed messages between the runtime processes (msgpack over ZMQ ipc:// sockets): a contract of
the runtime and the scheduler, so it sits below both (`radixserve.runtime.messages` re-exports it).

Flow: TokenizerManager -> Scheduler: GenerateRequest, AbortRequest, FlushCacheRequest, StatsRequest.
Scheduler -> Detokenizer: BatchTokenOut. Detokenizer -> TokenizerManager: BatchTextOut.
Scheduler -> TokenizerManager (directly): ReadyMessage, ControlReply.
Every message is a tagged msgspec Struct, so one decoder per socket handles a union of types.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from radixserve.state import SamplingParams  # a dataclass: msgspec encodes and decodes it as is


class GenerateRequest(msgspec.Struct, tag=True, kw_only=True):
    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    stream: bool = False
    priority: int = 0


class AbortRequest(msgspec.Struct, tag=True):
    rid: str


class FlushCacheRequest(msgspec.Struct, tag=True):
    req_id: int


class StatsRequest(msgspec.Struct, tag=True):
    req_id: int


class ShutdownRequest(msgspec.Struct, tag=True):
    pass


class ReqTokenOut(msgspec.Struct, kw_only=True):
    """New token ids of one request since its previous emission.

    `prompt_tail` (the last few prompt ids) is set on a request's first emission only: the
    detokenizer decodes new tokens in the context of their predecessors (leading spaces).
    A request that ended on a stop string (finished_reason {"type": "stop", "matched": <str>}) sends
    the tokens that made the stop string as the last `num_stop_tokens` of `new_ids`: decoded, so the
    text can be cut where the stop string starts, but not returned; the logprobs leave them out.
    `no_stop_trim` (the request's): the text is cut where the stop string ends instead (and
    `num_stop_tokens` is 0: its tokens are returned)."""

    rid: str
    new_ids: list[int]
    finished_reason: dict[str, Any] | None = None
    num_stop_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    skip_special_tokens: bool = True
    stop: list[str] = []
    no_stop_trim: bool = False
    # leading output tokens a stop string may not end in (the request's min_new_tokens; grows, then stays)
    stop_hold: int = 0
    stream: bool = False
    prompt_tail: list[int] | None = None
    token_logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    # SamplingParams.prompt_logprobs, on the request's first emission only: prompt token i+1's logprob
    # for each prompt position i, its rank there (1: the likeliest token), and (token id, logprob)
    # alternatives when prompt_logprobs > 0
    prompt_token_logprobs: list[float] | None = None
    prompt_token_ranks: list[int] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None
    error: str | None = None  # set when the scheduler rejects the request (it never ran)
    error_status: int = 400
    # speculative decoding, totals so far: verify steps with a draft, draft tokens accepted in them
    spec_verify_ct: int = 0
    spec_accepted_drafts: int = 0


class BatchTokenOut(msgspec.Struct, tag=True):
    outs: list[ReqTokenOut]


class ReqTextOut(msgspec.Struct, kw_only=True):
    """Detokenized delta of one request: text and ids appended since the previous item."""

    rid: str
    text_delta: str
    new_ids: list[int]
    finished_reason: dict[str, Any] | None = None
    completion_tokens: int = 0
    cached_tokens: int = 0
    token_logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    prompt_token_logprobs: list[float] | None = None  # once, on the first item (see ReqTokenOut)
    prompt_token_ranks: list[int] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None
    spec_verify_ct: int = 0  # speculative decoding totals (see ReqTokenOut)
    spec_accepted_drafts: int = 0
    error: str | None = None
    error_status: int = 400


class BatchTextOut(msgspec.Struct, tag=True):
    outs: list[ReqTextOut]


class ReadyMessage(msgspec.Struct, tag=True, kw_only=True):
    """Sent once by a child when it is ready to serve (the scheduler: model loaded)."""

    process: str  # "scheduler" | "detokenizer"
    info: dict[str, Any] = {}


class ControlReply(msgspec.Struct, tag=True, kw_only=True):
    req_id: int
    ok: bool = True
    data: dict[str, Any] = {}


class ChildFailed(msgspec.Struct, tag=True, kw_only=True):
    """A child reports a fatal error before exiting (e.g. the model failed to load)."""

    process: str
    error: str
    # set when the failure is a bad value the user gave (a ValueError such as a ConfigError, a missing
    # file, a refused plugin component): its message, which `serve` reports as one line with exit 2
    # (as `generate` does); None for a crash
    user_error: str | None = None
    # which of those it is, so the Engine raises the type it documents: "value", "file" or "plugin"
    user_error_kind: Literal["value", "file", "plugin"] | None = None


SchedulerInput = GenerateRequest | AbortRequest | FlushCacheRequest | StatsRequest | ShutdownRequest
DetokenizerInput = BatchTokenOut | ShutdownRequest
ManagerInput = BatchTextOut | ReadyMessage | ControlReply | ChildFailed


def make_encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder()


def scheduler_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(SchedulerInput)


def detokenizer_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(DetokenizerInput)


def manager_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(ManagerInput)
