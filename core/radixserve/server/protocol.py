"""Request and response models of the HTTP API: OpenAI chat/completions/models, and the native
/generate route (SGLang shape).

Requests forbid unknown fields: a parameter we would silently ignore (response_format, ...) is a
400 naming it, never a quietly different result. Tool calling and reasoning fields are in
protocol_tools.py. Fields OpenAI clients send that change
nothing here (user, store, metadata) are accepted and ignored.

As OpenAI does: types are strict (`"5"` or `true` is no integer; an integer is a fine float), an
explicit null means the parameter's default, and every string of a body must be valid Unicode (a
lone surrogate escape such as `"\\ud800"` is valid JSON but no text: a 400 naming where it is).
`refuse(param, message)` is how a check across fields names its field (errors.py reports it)."""

from __future__ import annotations

import json
import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer, model_validator
from pydantic_core import PydanticCustomError

from radixserve.server.protocol_tools import ChatToolFields, DeltaToolCall, ToolCall, ToolChoice, ToolDefinition
from radixserve.validation import (
    MAX_N,
    MAX_STOP_STRINGS,
    PRIORITY_MAX,
    PRIORITY_MIN,
    InvalidRequest,
    check_min_tokens,
    is_text,
    too_many_completions,
)


def refuse(param: str, message: str) -> PydanticCustomError:
    """A validation error about `param` (relative to the model that raises it): errors.py reports
    it as the error's `param`, where pydantic would name the whole model (or the body)."""
    return PydanticCustomError("invalid_request", "{message}", {"message": message, "param": param})


def _surrogate_at(body: dict[str, Any]) -> str | None:
    """The dotted path of a string (or object key) of the body holding a lone surrogate, else None.
    Iterative: a deeply nested body must not exhaust the stack."""
    todo: list[tuple[str, Any]] = [("", body)]
    while todo:
        path, value = todo.pop()
        if isinstance(value, str) and not is_text(value):
            return path
        if isinstance(value, dict):
            for key, item in value.items():
                where = f"{path}.{key}" if path else str(key)
                if isinstance(key, str) and not is_text(key):
                    return where.encode("utf-8", "backslashreplace").decode()  # the path goes back as JSON
                todo.append((where, item))
        elif isinstance(value, list):
            todo.extend((f"{path}.{i}", item) for i, item in enumerate(value))
    return None


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        # OpenAI marks its optional parameters nullable (its clients send null): null = the default
        if isinstance(data, dict):
            optional = {n for name, f in cls.model_fields.items() if not f.is_required() for n in (name, f.alias)}
            data = {k: v for k, v in data.items() if v is not None or k not in optional}
        return data


class _Body(_Request):
    """A route's whole request body: checked once for text that is not valid Unicode (the tokenizer,
    the stop matcher and the grammar compiler would each fail on it with a 500)."""

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        where = _surrogate_at(data) if isinstance(data, dict) else None
        if where is not None:
            raise refuse(where, "contains a lone UTF-16 surrogate escape (such as \\ud800), which is not valid text")
        return data


class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # usage on every chunk (vLLM extension)

    @property
    def final_usage(self) -> bool:
        """Whether the stream ends with the request's usage chunk: continuous_usage_stats' chunks carry each
        choice's own counts, so it brings the request's total too (stream audit 31: with n > 1 and it alone
        the last usage a client saw was one choice's); not when the client set include_usage false, as vLLM,
        whose clients may read `choices[0]` of every chunk."""
        if "include_usage" in self.model_fields_set:  # an explicit false: no usage chunk with empty choices (audit 34)
            return self.include_usage
        return self.include_usage or self.continuous_usage_stats


class JsonSchemaFormat(_Request):
    """`response_format.json_schema`: OpenAI's named schema. `strict` is accepted either way: the
    grammar backend always enforces the whole schema (outputs never leave it)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    """OpenAI `response_format`: free text, any JSON object, or JSON following a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_matches_type(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise refuse("json_schema", 'required when type is "json_schema"')
        if self.type != "json_schema" and self.json_schema is not None:
            raise refuse("json_schema", f'only allowed with type "json_schema", not {self.type!r}')
        return self

    def schema_text(self) -> str | None:
        """The JSON schema the output must follow, as JSON text (None: unconstrained text)."""
        if self.type == "json_object":
            return '{"type": "object"}'
        if self.type == "json_schema":
            schema = self.json_schema.schema_ if self.json_schema is not None else None
            return json.dumps({} if schema is None or schema is True else schema)
        return None


class _SamplingFields(_Body):
    """OpenAI sampling fields shared by chat and text completions, plus SGLang/vLLM extensions."""

    model: str | None = None  # left out: the served model (as vLLM and SGLang; OpenAI requires it)
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0, allow_inf_nan=False)
    # 0 keeps only the most likely token (greedy), as OpenAI accepts 0..1
    top_p: float | None = Field(default=None, ge=0.0, le=1.0, allow_inf_nan=False)
    stop: str | list[str] | None = None
    seed: int | None = None
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    # extensions (SGLang / vLLM names)
    top_k: int = Field(default=-1, ge=-1)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0, allow_inf_nan=False)
    min_tokens: int = Field(default=0, ge=0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, allow_inf_nan=False)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False  # vLLM's: a matched stop string stays in the text (SGLang's no_stop_trim)
    rid: str | None = Field(default=None, max_length=200)  # caller-chosen request id (for /abort_request)
    priority: int = Field(default=0, ge=PRIORITY_MIN, le=PRIORITY_MAX)  # higher first under the `priority` policy
    response_format: ResponseFormat | None = None  # structured output (docs/structured-output.md)

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, stop: str | list[str] | None) -> str | list[str] | None:
        if stop == "":  # as OpenAI: an empty stop is no stop (an empty string inside a list is an error)
            return None
        if isinstance(stop, list) and "" in stop:
            raise ValueError('an empty string cannot be a stop string (a stop of "" alone means none)')
        if isinstance(stop, list) and len(stop) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}")
        return stop

    @model_validator(mode="after")
    def _check_fields(self) -> _SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise refuse("stream_options", "only allowed when stream is true")  # as OpenAI
        name, max_tokens = self.max_tokens_field()
        try:  # the same rule as /generate's min_new_tokens (validation.py)
            check_min_tokens(self.min_tokens, max_tokens, "min_tokens", name)
        except InvalidRequest as e:
            raise refuse(e.param or "min_tokens", e.message) from None
        return self

    def max_tokens_field(self) -> tuple[str, int | None]:
        """The name and value of the request's max_tokens field (None: not given)."""
        raise NotImplementedError

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class TextPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant: the calls it made
    tool_call_id: str | None = None  # tool: the call this message answers
    reasoning_content: str | None = None  # assistant: its reasoning (templates that show it)
    # assistant fields of OpenAI's response message, sent back by clients that replay
    # `message.model_dump()`: accepted and not shown to the model
    refusal: str | None = None
    annotations: list[Any] | None = None
    audio: dict[str, Any] | None = None
    function_call: dict[str, Any] | None = None  # deprecated form of tool_calls

    @model_validator(mode="before")
    @classmethod
    def _text_parts_only(cls, data: Any) -> Any:
        # an image / audio / file part: one error saying so, not pydantic's four about the union
        content = data.get("content") if isinstance(data, dict) else None
        for i, part in enumerate(content if isinstance(content, list) else []):
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and kind != "text":
                raise refuse(f"content.{i}", f"content part type {kind!r} is not supported (text only)")
        return data

    @model_validator(mode="after")
    def _check_tool_fields(self) -> ChatMessage:
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages have tool_calls")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        if self.tool_call_id is not None and self.role != "tool":
            raise ValueError("only tool messages have a tool_call_id")
        for name in ("refusal", "annotations", "audio", "function_call"):
            if getattr(self, name) is not None and self.role != "assistant":
                raise refuse(name, "only assistant messages have it")
        # as OpenAI: content is required (and a list of parts not empty), except on an assistant
        # message that made calls (or refused)
        if self.content == []:
            raise refuse("content", "must not be an empty list of parts")
        if self.content is None and not (self.role == "assistant" and (self.tool_calls or self.function_call
                                                                         or self.refusal is not None)):
            raise refuse("content", f"{'an' if self.role == 'assistant' else 'a'} {self.role} message needs content")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(p.text for p in self.content)  # as vLLM joins them: two parts stay two words


def _check_prompt_logprobs(req: CompletionRequest | ChatCompletionRequest) -> None:
    if req.prompt_logprobs is not None and req.stream:
        raise refuse("prompt_logprobs", "not available with stream=true (vLLM's rule too)")


class ChatCompletionRequest(_SamplingFields, ChatToolFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    add_generation_prompt: bool = True
    # vLLM's extension: each prompt token's logprob given the tokens before it, with this many
    # alternatives (the response's top-level `prompt_logprobs`); not with stream
    prompt_logprobs: int | None = Field(default=None, ge=0, le=20)

    @model_validator(mode="after")
    def _check_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise refuse("top_logprobs", "requires logprobs=true")
        _check_prompt_logprobs(self)
        if None not in (self.max_tokens, self.max_completion_tokens) and self.max_tokens != self.max_completion_tokens:
            raise refuse("max_tokens", f"max_tokens ({self.max_tokens}) differs from max_completion_tokens "
                                       f"({self.max_completion_tokens}): send one of them (max_tokens is its older name)")
        return self

    @model_validator(mode="after")
    def _check_tool_results_follow_calls(self) -> ChatCompletionRequest:
        # as OpenAI: a tool message answers a call of the assistant message before it (or of the
        # assistant message before a run of tool messages)
        for i, m in enumerate(self.messages):
            if m.role == "assistant" and m.tool_calls:
                first: dict[str, int] = {}
                for j, call in enumerate(m.tool_calls):  # a tool message names the call it answers by its id
                    k = first.setdefault(call.id, j)
                    if k != j:
                        raise refuse(f"messages.{i}.tool_calls.{j}.id", f"{call.id!r} is the id of tool_calls.{k} "
                                                                         "too: each call of a message has its own id")
            if m.role != "tool":
                continue
            before = next((b for b in reversed(self.messages[:i]) if b.role != "tool"), None)
            if before is None or before.role != "assistant" or not before.tool_calls:
                raise refuse(f"messages.{i}", "a tool message must follow an assistant message with tool_calls "
                                              "(the call it answers)")
            ids = [c.id for c in before.tool_calls]
            if m.tool_call_id not in ids:  # as OpenAI; the message would be rendered answering no call
                raise refuse(f"messages.{i}.tool_call_id", f"{m.tool_call_id!r} is not the id of a call of the "
                                                           f"assistant message it answers ({', '.join(map(repr, ids))})")
        return self

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def text_chars(self) -> int:
        """Characters of the conversation's text: how much rendering and tokenizing it costs."""
        return sum(len(m.text()) for m in self.messages)

    def max_tokens_field(self) -> tuple[str, int | None]:
        if self.max_completion_tokens is not None:
            return "max_completion_tokens", self.max_completion_tokens
        return "max_tokens", self.max_tokens




class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int = Field(default=16, ge=0)  # OpenAI's default for text completions; 0 only with echo
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    best_of: int | None = Field(default=None, ge=1)
    suffix: str | None = None  # only null (the default): insertion is not supported
    # vLLM's extension: each prompt token's logprob given the tokens before it, with this many
    # alternatives (each choice's `prompt_logprobs`); not with stream
    prompt_logprobs: int | None = Field(default=None, ge=0, le=20)

    @model_validator(mode="after")
    def _check(self) -> CompletionRequest:
        if self.suffix is not None:
            raise refuse("suffix", "text after the completion (suffix) is not supported")
        _check_prompt_logprobs(self)
        if self.max_tokens == 0 and not self.echo:
            raise refuse("max_tokens", "must be at least 1 (0 only with echo: the prompt alone, e.g. for its logprobs)")
        if self.best_of is not None and self.best_of != self.n:
            raise refuse("best_of", "best_of other than n is not supported")
        if isinstance(self.prompt, list) and len(self.prompt) == 0:
            raise refuse("prompt", "must not be empty")
        too_many = None if self._single_prompt() else too_many_completions(len(self.prompt), self.n)
        if too_many:
            raise refuse("prompt", too_many)
        for i, p in enumerate(self.prompt if isinstance(self.prompt, list) else []):
            if isinstance(p, list) and not p:
                raise refuse(f"prompt[{i}]", "a token list must not be empty")
        return self

    def max_tokens_field(self) -> tuple[str, int | None]:
        return "max_tokens", self.max_tokens

    def prompts(self) -> list[str | list[int]]:
        """Each prompt of the request: a string or a list of token ids."""
        if self._single_prompt():
            return [self.prompt if isinstance(self.prompt, str) else list(self.prompt)]  # type: ignore[arg-type]
        return list(self.prompt)  # type: ignore[arg-type]

    def prompt_field(self, k: int) -> str:
        """The field path of prompt k in errors: `prompt` for a single prompt (a string or one list of
        ids), `prompt[k]` for an entry of a list of prompts, even a list holding only one."""
        return "prompt" if self._single_prompt() else f"prompt[{k}]"

    def _single_prompt(self) -> bool:
        return isinstance(self.prompt, str) or all(isinstance(x, int) for x in self.prompt)


Rid = Annotated[str, Field(max_length=200)]
# /generate fields that SGLang also takes as one value per prompt; here one value applies to every prompt
_ONE_FOR_ALL = ("return_logprob", "top_logprobs_num", "logprob_start_len", "priority")


class GenerateRequest(_Body):
    """Native /generate (SGLang's shape): one prompt (`text` a string, `input_ids` a list of ids) or a batch
    (a list of texts, a list of id lists), each sampled `sampling_params.n` times; SGLang's sampling
    parameter names. `sampling_params` and `rid` are one for all or a list of one per prompt."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] = Field(default_factory=dict)
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = Field(default=0, ge=0, le=20)
    # SGLang's: with return_logprob, >= 0 also returns the prompt's logprobs from this position on
    # (meta_info input_token_logprobs / input_top_logprobs); -1: none
    logprob_start_len: int = Field(default=-1, ge=-1)
    rid: Rid | list[Rid] | None = None
    priority: int = Field(default=0, ge=PRIORITY_MIN, le=PRIORITY_MAX)  # higher first under the `priority` policy

    @model_validator(mode="before")
    @classmethod
    def _one_value_for_all(cls, data: Any) -> Any:
        # SGLang's per-prompt list of these: one sentence saying so, not pydantic's "valid boolean"
        for name in _ONE_FOR_ALL if isinstance(data, dict) else ():
            if isinstance(data.get(name), list):
                raise refuse(name, "takes one value for every prompt of the request here (SGLang's list of one "
                                   "per prompt is not supported): send prompts that differ in it as separate requests")
        return data

    @model_validator(mode="after")
    def _check_prompts(self) -> GenerateRequest:
        if (self.text is None) == (self.input_ids is None):
            raise refuse("text", "give exactly one of text or input_ids")
        if self.text == [] or self.input_ids == []:  # (an empty text is one empty prompt: refused as such later)
            raise refuse("text" if self.text is not None else "input_ids", "must not be empty")
        if self.is_batch() and self.input_ids is not None:
            for k, ids in enumerate(self.input_ids):
                if not ids:
                    raise refuse(f"input_ids[{k}]", "a token list must not be empty")
        count = len(self.prompts())
        for name, value in (("sampling_params", self.sampling_params), ("rid", self.rid)):
            if isinstance(value, list) and len(value) != count:
                raise refuse(name, f"a list of {len(value)} for {count} prompt{'s' if count > 1 else ''}: give one "
                                   f"for all prompts{' (an object)' if name == 'sampling_params' else ''}, or a list of "
                                   "one per prompt")
        if isinstance(self.rid, list) and len(set(self.rid)) != count:
            raise refuse("rid", "the rids of one batch must be distinct")
        if self.top_logprobs_num and not self.return_logprob:  # as OpenAI's top_logprobs: never ignored
            raise refuse("top_logprobs_num", "requires return_logprob=true")
        if self.logprob_start_len >= 0 and not self.return_logprob:
            raise refuse("logprob_start_len", "requires return_logprob=true")
        return self

    def is_batch(self) -> bool:
        """SGLang's batch form (a list of texts or of id lists): its answer is a list, even of one."""
        return isinstance(self.text, list) or (bool(self.input_ids) and isinstance(self.input_ids[0], list))

    def prompts(self) -> list[str | list[int]]:
        """Each prompt of the request: a string or a list of token ids."""
        given = self.text if self.text is not None else self.input_ids
        return list(given) if self.is_batch() else [given]  # type: ignore[arg-type, list-item]

    def prompt_field(self, k: int) -> str:
        """The field path of prompt k in errors: `text` / `input_ids` for one prompt, `text[k]` /
        `input_ids[k]` for an entry of a batch."""
        name = "text" if self.text is not None else "input_ids"
        return f"{name}[{k}]" if self.is_batch() else name


class TokenizeRequest(_Body):
    """vLLM's /tokenize: a text `prompt`, or chat `messages` rendered as /v1/chat/completions renders
    them (its template, `tools` and `chat_template_kwargs`)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # a prompt's BOS etc. (default true); a chat template writes its own
    add_generation_prompt: bool = True
    tools: list[ToolDefinition] | None = Field(default=None, max_length=128)
    tool_choice: ToolChoice | None = None  # as the chat route's: "none" renders without the tools
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise refuse("prompt", "give exactly one of prompt or messages")
        if self.messages is not None and self.add_special_tokens:
            raise refuse("add_special_tokens", "only with prompt: the chat template writes the special tokens")
        if self.messages is not None and not self.messages:
            raise refuse("messages", "must not be empty")
        return self


class DetokenizeRequest(_Body):
    """vLLM's /detokenize: token ids back to text."""

    model: str | None = None
    tokens: list[int]


class AbortRequest(_Body):
    """/abort_request: one request by `rid`, or (SGLang's `abort_all: true`) every request in flight."""

    rid: str = ""
    abort_all: bool = False

    @model_validator(mode="after")
    def _one_target(self) -> AbortRequest:
        if not self.rid and not self.abort_all:
            raise refuse("rid", "give the rid of the request to abort, or abort_all: true")
        if self.rid and self.abort_all:
            raise refuse("abort_all", "give either a rid or abort_all: true, not both")
        return self


# ---- responses ----------------------------------------------------------------------------------


class PromptTokensDetails(_Response):
    cached_tokens: int = 0


class UsageInfo(_Response):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(_Response):
    content: list[ChatTokenLogprob] = Field(default_factory=list)


class ChatResponseMessage(_Response):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None  # omitted when None (no reasoning parser, or none found)
    tool_calls: list[ToolCall] | None = None  # omitted when None

    @model_serializer(mode="wrap")
    def _omit_absent(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None or k == "content"}


class ChatChoice(_Response):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    matched_stop: int | str | None = None  # SGLang extension: the stop string / token that ended it


class PromptLogprob(_Response):
    """One token's entry in vLLM's `prompt_logprobs`: its logprob, its rank among the vocabulary (1:
    the likeliest) and its text."""

    logprob: float
    rank: int | None  # None only from a runner that reports no ranks
    decoded_token: str


# vLLM's `prompt_logprobs`: per prompt token, None for the first (nothing predicts it), else the token's
# entry and its alternatives', keyed by token id (as a string, JSON's keys)
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs | None = Field(default=None, exclude_if=lambda v: v is None)  # only when asked


class DeltaMessage(_Response):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _omit_none(self, handler):  # OpenAI sends only the delta's present keys
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(_Response):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    matched_stop: int | str | None = None


class ChatCompletionChunk(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class CompletionLogprobs(_Response):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    matched_stop: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = Field(default=None, exclude_if=lambda v: v is None)  # only when asked


class CompletionResponse(_Response):
    """Both the full response and each streamed chunk (OpenAI uses one shape for both)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "radixserve"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]
