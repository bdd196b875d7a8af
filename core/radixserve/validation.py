"""The one place that decides whether a generation request is acceptable, and its token budget.

Every entry point goes through these functions: the HTTP handlers (with the API's field names, so a
400 names the field the client sent), the TokenizerManager for the Engine and every other caller,
and the scheduler as a defensive backstop (`reject_reason`). They check what would otherwise fail
deep inside the model process: token ids outside the vocabulary (the embedding would raise
IndexError), logit-bias keys and stop ids outside it, non-finite or mistyped sampling values, and a
prompt plus max_new_tokens longer than the context."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from radixserve.errors import RequestError
from radixserve.state import SamplingParams, sample_copy

INT64_MAX = (1 << 63) - 1
# OpenAI's `code` of a request too long for the model: client frameworks test for this string
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
LOGIT_BIAS_LIMIT = 100.0  # OpenAI's range for a logit-bias value
MAX_STOP_STRINGS = 16
# a request's `priority`: a signed 32-bit int (SGLang's range), on the HTTP routes and the Engine alike
PRIORITY_MIN, PRIORITY_MAX = -(2**31), 2**31 - 1
# samples per prompt (`n`) of one HTTP request: the OpenAI routes' field and /generate's sampling_params.n
MAX_N = 128
# prompts x n of one /v1/completions, /generate or Engine.generate request: more, in one small body, would queue
# ahead of everyone else's
MAX_COMPLETIONS_PER_REQUEST = 1024


def too_many_completions(prompts: int, n: int) -> str | None:
    """Why `prompts` prompts sampled `n` times each are refused in one request (None: they are not).
    Fuzz audit 31: 10,000 prompts in a 60 KB body held the scheduler for a minute, ahead of every
    request that came after it."""
    if prompts * n <= MAX_COMPLETIONS_PER_REQUEST:
        return None
    return (f"at most {MAX_COMPLETIONS_PER_REQUEST} completions in one request (prompts times n; got {prompts} x "
            f"{n}): send the rest in other requests")


class InvalidRequest(RequestError, ValueError):
    """A request that can never run; `param` names the offending field (OpenAI's error `param`).
    Also a ValueError: the Engine documents ValueError for bad parameters (the HTTP layer catches
    RequestError / InvalidRequest by name, so this changes nothing there)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message, status=400)
        self.param = param
        self.code = code  # OpenAI's error `code` where it has a name for it (None: the status)


def check_same_n(sp: SamplingParams, k: int, first: SamplingParams) -> None:
    """Entry `k` of a per-prompt sampling_params list samples its prompt as many times as entry 0 (/generate and
    Engine.generate: result k * n + i is sample i of prompt k; SGLang's rule too)."""
    if sp.n != first.n:
        raise InvalidRequest(f"sampling_params[{k}].n ({sp.n}) differs from sampling_params[0].n ({first.n}): every "
                             "prompt of a batch is sampled as many times", f"sampling_params[{k}].n")


def check_copy_seeds(sp: SamplingParams, limits: ModelLimits, names: FieldNames) -> None:
    """Copy i of a prompt sampled `sp.n` times runs with seed + i (state.sample_copy): the last copy's seed must be a
    valid seed too, refused now rather than by the runtime once the other copies run."""
    if sp.seed is not None and sp.n > 1:
        check_sampling(sample_copy(sp, sp.n - 1), limits, names)


def at_prompt(e: InvalidRequest, where: str) -> InvalidRequest:
    """`e`, a refusal naming `sampling_params.<field>`, as one naming `<where>.<field>` (`sampling_params[1]`: the
    entry of a per-prompt list the runtime refused, e.g. its regex that does not compile); else `e` itself."""
    prefix = "sampling_params."
    if not (e.param or "").startswith(prefix):
        return e
    field = f"{where}.{e.param[len(prefix):]}"
    text = str(e)
    return InvalidRequest(field + text[len(e.param):] if text.startswith(e.param) else f"{field}: {text}", field, e.code)


@dataclass(frozen=True)
class ModelLimits:
    """What a request is checked against: the served model's vocabulary and context length
    (0 = unknown, not checked)."""

    vocab_size: int = 0
    context_len: int = 0

    @classmethod
    def from_server_info(cls, info: Mapping[str, Any]) -> ModelLimits:
        return cls(vocab_size=int(info.get("vocab_size") or 0), context_len=int(info.get("context_len") or 0))


@dataclass(frozen=True)
class FieldNames:
    """How the caller's API spells each checked field (the error names the field the client sent)."""

    prompt: str = "input_ids"
    max_new_tokens: str = "max_new_tokens"
    sampling: str = ""  # prefix of the sampling fields, e.g. "sampling_params."
    renamed: tuple[tuple[str, str], ...] = ()  # (SamplingParams field, the API's name) where they differ

    def of(self, name: str) -> str:
        return f"{self.sampling}{dict(self.renamed).get(name, name)}"


NATIVE = FieldNames(prompt="input_ids", max_new_tokens="sampling_params.max_new_tokens", sampling="sampling_params.")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def _shown(value: Any) -> str:
    """`value` for an error message, cut to 80 characters (a 400-digit JSON integer is a valid number)."""
    if _is_int(value) and abs(value) >= 10**70:  # (str() of one past 4,300 digits raises)
        return f"an integer of about {int(abs(value).bit_length() * math.log10(2)) + 1} digits"
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:77]}..."


def is_text(value: str) -> bool:
    """Whether a str is valid Unicode text: JSON's `"\\ud800"` (a lone surrogate) parses to a Python
    str that no tokenizer, stop matcher or message encoder accepts."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def check_text(value: str, field: str) -> None:
    if not is_text(value):
        raise InvalidRequest(f"{field} contains a lone UTF-16 surrogate, which is not valid text", field)


def check_min_tokens(min_tokens: int, max_tokens: int | None, min_field: str, max_field: str) -> None:
    """min_tokens must not exceed max_tokens (None: not given, the rest of the context); one rule
    for /generate, the OpenAI routes and the Engine."""
    if max_tokens is not None and min_tokens > max_tokens:
        raise InvalidRequest(f"{min_field} ({min_tokens}) must not exceed {max_field} ({max_tokens})", min_field)


def check_token_ids(ids: Iterable[Any], limits: ModelLimits, field: str) -> None:
    """Every id an int in [0, vocab_size); the error names the position (`field[i]`)."""
    vocab = limits.vocab_size
    for i, tid in enumerate(ids):
        if not _is_int(tid):
            raise InvalidRequest(f"{field}[{i}] must be an integer token id, got {tid!r}", field)
        if tid < 0 or (vocab and tid >= vocab):
            bound = f"[0, {vocab})" if vocab else "[0, vocabulary size)"
            raise InvalidRequest(f"{field}[{i}] token id {tid} is out of range {bound}", field)


def parse_logit_bias(bias: Mapping[Any, Any] | None, limits: ModelLimits, field: str = "logit_bias") -> dict[int, float] | None:
    """OpenAI's {"token id as string": bias} (or int keys) -> {id: bias}, every key in the vocabulary
    and every value a finite number in [-100, 100]."""
    if bias is None:
        return None
    if not isinstance(bias, Mapping):
        raise InvalidRequest(f"{field} must be an object mapping token ids to biases", field)
    out: dict[int, float] = {}
    vocab = limits.vocab_size
    for key, value in bias.items():
        tid = key
        if isinstance(key, str):
            try:
                tid = int(key)
            except ValueError:
                raise InvalidRequest(f"{field} keys must be token ids, got {key!r}", field) from None
        if not _is_int(tid) or tid < 0 or (vocab and tid >= vocab):
            bound = f"[0, {vocab})" if vocab else "[0, vocabulary size)"
            raise InvalidRequest(f"{field} key {key!r} is not a token id in {bound}", field)
        if not _is_number(value) or not math.isfinite(value) or abs(value) > LOGIT_BIAS_LIMIT:
            raise InvalidRequest(f"{field}[{key!r}] must be a number in [-100, 100], got {value!r}", field)
        out[tid] = float(value)
    return out or None


# type of each SamplingParams field: what a client (JSON, or Python through the Engine) may pass
_INTS = ("max_new_tokens", "min_new_tokens", "top_k", "top_logprobs", "n")
_FLOATS = ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty")
_BOOLS = ("ignore_eos", "skip_special_tokens", "logprobs")


def check_sampling(sp: SamplingParams, limits: ModelLimits, names: FieldNames = NATIVE) -> None:
    """Types, ranges and vocabulary of every sampling field; raises InvalidRequest naming the field."""
    if not isinstance(sp, SamplingParams):
        raise InvalidRequest(f"sampling_params must be a SamplingParams or a dict, got {type(sp).__name__}", "sampling_params")
    for name in _INTS:
        value = getattr(sp, name)
        if not _is_int(value) or abs(value) > INT64_MAX:
            field = names.max_new_tokens if name == "max_new_tokens" else names.of(name)
            what = "a 64-bit integer" if _is_int(value) else "an integer"
            raise InvalidRequest(f"{field} must be {what}, got {_shown(value)}", field)
    for name in ("max_new_tokens", "min_new_tokens"):  # before comparing them: name the negative one
        if getattr(sp, name) < 0:
            field = names.max_new_tokens if name == "max_new_tokens" else names.of(name)
            raise InvalidRequest(f"{field} must be an integer >= 0, got {getattr(sp, name)!r}", field)
    for name in _FLOATS:
        value = getattr(sp, name)
        try:  # as a float from here on: a huge JSON integer (2**70) could not be sent to the scheduler
            finite = _is_number(value) and math.isfinite(value) and math.isfinite(float(value))
        except OverflowError:  # an integer past float's range
            finite = False
        if not finite:
            raise InvalidRequest(f"{names.of(name)} must be a finite number, got {_shown(value)}", names.of(name))
        setattr(sp, name, float(value))
    for name in _BOOLS:
        if not isinstance(getattr(sp, name), bool):
            raise InvalidRequest(f"{names.of(name)} must be true or false, got {getattr(sp, name)!r}", names.of(name))
    if sp.prompt_logprobs is not None and not _is_int(sp.prompt_logprobs):
        field = names.of("prompt_logprobs")
        raise InvalidRequest(f"{field} must be null or an integer in [0, 20], got {sp.prompt_logprobs!r}", field)
    if sp.seed is not None and (not _is_int(sp.seed) or not -INT64_MAX - 1 <= sp.seed <= INT64_MAX):
        raise InvalidRequest(f"{names.of('seed')} must be a 64-bit integer, got {sp.seed!r}", names.of("seed"))
    stop = sp.stop
    if isinstance(stop, list) and "" in stop:
        raise InvalidRequest(f"{names.of('stop')}: an empty string cannot be a stop string (a stop of \"\" alone "
                             "means none)", names.of("stop"))
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise InvalidRequest(f"{names.of('stop')} must be a string or a list of strings, got {_shown(stop)}",
                             names.of("stop"))
    if len(stop) > MAX_STOP_STRINGS:
        raise InvalidRequest(f"{names.of('stop')}: at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}",
                             names.of("stop"))
    for s in stop:
        check_text(s, names.of("stop"))
    for name in ("json_schema", "regex", "ebnf", "grammar_after"):
        if isinstance(getattr(sp, name), str):
            check_text(getattr(sp, name), names.of(name))
    if not isinstance(sp.stop_token_ids, list):
        raise InvalidRequest(f"{names.of('stop_token_ids')} must be a list of token ids", names.of("stop_token_ids"))
    check_token_ids(sp.stop_token_ids, limits, names.of("stop_token_ids"))
    if sp.logit_bias is not None:
        sp.logit_bias = parse_logit_bias(sp.logit_bias, limits, names.of("logit_bias"))
    check_min_tokens(sp.min_new_tokens, sp.max_new_tokens, names.of("min_new_tokens"), names.max_new_tokens)
    try:
        sp.validate()
    except ValueError as e:
        first = str(e).split(" ", 1)[0]  # SamplingParams.validate's messages start with the field
        raise InvalidRequest(f"{names.sampling}{e}", names.of(first)) from None


def sampling_params_from(d: Any, limits: ModelLimits, names: FieldNames = NATIVE) -> SamplingParams:
    """A sampling dict (SGLang names) -> type- and range-checked SamplingParams: the conversion
    /generate and the Engine share (a json_schema object is dumped to text, a str stop is a list)."""
    if d is None:
        d = {}
    if not isinstance(d, Mapping):
        raise InvalidRequest(f"{names.sampling.rstrip('.') or 'sampling_params'} must be an object", "sampling_params")
    d = dict(d)
    known = set(SamplingParams.__dataclass_fields__)
    unknown = sorted(set(d) - known)
    if unknown:
        raise InvalidRequest(
            f"unknown sampling parameter(s) {unknown}; valid: {sorted(known)}", names.of(str(unknown[0]))
        )
    d = {k: v for k, v in d.items() if v is not None}  # null: the default, as on the OpenAI routes
    if isinstance(d.get("stop"), str):
        d["stop"] = [d["stop"]] if d["stop"] else []  # an empty stop is no stop (as OpenAI)
    if isinstance(d.get("json_schema"), dict | bool):  # a schema given as a JSON object, not as text
        d["json_schema"] = json.dumps(d["json_schema"])
    sp = SamplingParams(**d)
    check_sampling(sp, limits, names)
    return sp


def sampling_from_dict(d: Any, limits: ModelLimits, names: FieldNames = NATIVE, max_n: int = 1) -> SamplingParams:
    """A client's sampling dict (SGLang names) -> checked SamplingParams; unknown keys are an error.
    `max_n`: the most samples per prompt (`n`) the caller runs (see check_one_choice)."""
    return check_one_choice(sampling_params_from(d, limits, names), names, max_n)


def check_one_choice(sp: SamplingParams, names: FieldNames = NATIVE, max_n: int = 1) -> SamplingParams:
    """Refuse the fields SamplingParams has but the caller would silently ignore; returns `sp`.
    A generation makes one choice: `n` is only taken where the caller runs n generations of the
    prompt, up to `max_n` (/generate and Engine.generate: MAX_N); async_generate (`max_n` 1) refuses n > 1."""
    if sp.n != 1 and max_n == 1:
        raise InvalidRequest(
            f"{names.of('n')}: one completion per request here (Engine.generate and /generate take n); or send n "
            "requests, with seed + i for copy i as `n` does (one seed for all gives n equal samples)",
            names.of("n"),
        )
    if not 1 <= sp.n <= max_n:
        raise InvalidRequest(f"{names.of('n')} must be an integer in [1, {max_n}], got {_shown(sp.n)}", names.of("n"))
    if sp.top_logprobs and not sp.logprobs:
        raise InvalidRequest(
            f"{names.of('top_logprobs')} requires {names.of('logprobs')}=true (or use return_logprob with "
            "top_logprobs_num)",
            names.of("top_logprobs"),
        )
    return sp


def max_new_tokens_for(
    prompt_len: int, requested: int | None, limits: ModelLimits, names: FieldNames = NATIVE
) -> int:
    """The request's max_new_tokens: `requested`, or all the context the prompt leaves when None.
    Raises InvalidRequest when the prompt plus the budget cannot fit the context."""
    ctx = limits.context_len
    if prompt_len == 0:  # e.g. an empty text prompt: named as the client sent it, not as input_ids
        raise InvalidRequest(f"{names.prompt}: the prompt is empty", names.prompt)
    if requested is not None and (not _is_int(requested) or requested < 0):
        raise InvalidRequest(f"{names.max_new_tokens} must be an integer >= 0, got {requested!r}", names.max_new_tokens)
    if not ctx:
        if requested is None:
            raise InvalidRequest(f"{names.max_new_tokens} is required", names.max_new_tokens)
        return requested
    # the prompt alone too long names the prompt's field; a prompt that fits but leaves too little
    # room names max_tokens (lowering it is enough)
    if prompt_len >= ctx:
        raise InvalidRequest(
            f"the prompt has {prompt_len} tokens; the model's context length is {ctx} tokens", names.prompt,
            CONTEXT_LENGTH_EXCEEDED,
        )
    if requested is None:
        return ctx - prompt_len
    if prompt_len + requested > ctx:
        raise InvalidRequest(
            f"the prompt ({prompt_len} tokens) plus {names.max_new_tokens} ({requested}) exceeds the model's "
            f"context length ({ctx} tokens); shorten the prompt or lower {names.max_new_tokens}",
            names.max_new_tokens, CONTEXT_LENGTH_EXCEEDED,
        )
    return requested


def validate_request(ids: list[int], sp: SamplingParams, limits: ModelLimits, names: FieldNames = NATIVE) -> None:
    """The whole check of one tokenized request: prompt ids, sampling fields, context budget."""
    if not isinstance(ids, list):
        raise InvalidRequest(f"{names.prompt} must be a list of token ids", names.prompt)
    if not ids:
        raise InvalidRequest(f"{names.prompt}: the prompt is empty", names.prompt)
    check_token_ids(ids, limits, names.prompt)
    check_sampling(sp, limits, names)
    max_new_tokens_for(len(ids), sp.max_new_tokens, limits, names)


def reject_reason(ids: list[int], sp: SamplingParams, limits: ModelLimits) -> str | None:
    """`validate_request`'s verdict as a message (None: acceptable): the scheduler's backstop."""
    try:
        validate_request(ids, sp, limits)
    except InvalidRequest as e:
        return e.message
    return None
