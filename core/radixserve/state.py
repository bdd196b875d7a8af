"""Core state types shared by the scheduler, the model runner, attention backends and samplers.

Ownership (who writes each field) is noted per field; everyone else only reads.
Kept in one small file on purpose: these types are the vocabulary every plugin speaks.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from radixserve.interfaces.attention import AttentionBackend
    from radixserve.memory.kv_pool import KVPool
    from radixserve.memory.latent_pool import LatentKVPool
    from radixserve.memory.req_to_token import ReqToTokenPool


@dataclass
class SamplingParams:
    """Per-request sampling parameters (SGLang native names). Written by the API layer, then frozen
    by convention: the scheduler and sampler only read it."""

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    # SGLang's name (vLLM's include_stop_str_in_output on the OpenAI routes): a matched stop string stays at the
    # end of the text, its tokens in the output ids and logprobs; text after it in the same token is still cut.
    # A stop token id's text stays out either way
    no_stop_trim: bool = False
    logprobs: bool = False
    top_logprobs: int = 0  # number of top alternatives returned per token
    # logprobs of the prompt's tokens (vLLM's name): None = not computed; k >= 0 = each prompt token's
    # logprob given the tokens before it, with its k likeliest alternatives. Raw model logits (no
    # penalties, bias or temperature); the prefix cache is not used for such a request's prompt
    prompt_logprobs: int | None = None
    n: int = 1
    # Structured output (SGLang's native names; at most one may be set). Each is the constraint's
    # text: a JSON schema serialised as JSON (`{"type": "object"}` for any JSON object), a regex, an
    # EBNF grammar. Set by the API layer (response_format, tool_choice) or by /generate callers;
    # enforced by the grammar backend of the stack.
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    # the constraint starts once the output's text contains this marker (e.g. `</think>`: a reasoning
    # section before it is free, the answer after it is constrained); None: from the first token
    grammar_after: str | None = None

    @property
    def is_greedy(self) -> bool:
        # top_p 0 (OpenAI's range is [0, 1]) keeps only the most likely token, as top_k 1 does
        return self.temperature <= 0.0 or self.top_k == 1 or self.top_p <= 0.0

    def validate(self) -> None:
        """Raise ValueError with a message naming the bad field."""
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if self.min_new_tokens < 0 or self.min_new_tokens > max(self.max_new_tokens, 0):
            raise ValueError(f"min_new_tokens must be in [0, max_new_tokens], got {self.min_new_tokens}")
        if not 0 <= self.temperature < float("inf"):  # written so that NaN fails too
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0.0 <= self.top_p <= 1.0:
            raise ValueError(f"top_p must be in [0, 1], got {self.top_p}")
        if self.top_k < -1:  # 0 and -1 both disable it (vLLM's default is 0, SGLang's -1)
            raise ValueError(f"top_k must be >= 1, or 0 or -1 (disabled), got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not 0 < self.repetition_penalty < float("inf"):
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not 0 <= self.top_logprobs <= 20:
            raise ValueError(f"top_logprobs must be in [0, 20], got {self.top_logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            raise ValueError(f"prompt_logprobs must be None or in [0, 20], got {self.prompt_logprobs}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        constraints = [k for k in ("json_schema", "regex", "ebnf") if getattr(self, k) is not None]
        for k in constraints:
            if not isinstance(getattr(self, k), str) or not getattr(self, k):
                raise ValueError(f"{k} must be a non-empty string, got {getattr(self, k)!r}")
        if len(constraints) > 1:
            raise ValueError(f"{constraints[1]} cannot be combined with {constraints[0]}: give at most one of json_schema, regex, ebnf")
        if self.json_schema is not None:
            _check_json_schema_text(self.json_schema)
        if self.grammar_after is not None:
            if not isinstance(self.grammar_after, str) or not self.grammar_after:
                raise ValueError(f"grammar_after must be a non-empty string, got {self.grammar_after!r}")
            if not constraints:
                raise ValueError("grammar_after needs a constraint (json_schema, regex or ebnf) to start")

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> SamplingParams:
        """Build from a user dict; unknown keys are an error naming them (never silently dropped)."""
        d = dict(d or {})
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s) {unknown}; valid: {sorted(known)}")
        if isinstance(d.get("stop"), str):
            d["stop"] = [d["stop"]]
        if d.get("logit_bias"):
            d["logit_bias"] = {int(k): float(v) for k, v in d["logit_bias"].items()}
        p = cls(**d)
        p.validate()
        return p


def copy_seed(seed: int | None, copy: int) -> int | None:
    """The seed of copy `copy` of a prompt sampled n times (the OpenAI routes' `n`, /generate's and the
    Engine's sampling_params.n): seed + copy, so that copies differ under a fixed seed, yet stay reproducible."""
    return None if seed is None else seed + copy


def sample_copy(sp: SamplingParams, copy: int) -> SamplingParams:
    """Copy `copy` of a prompt sampled `sp.n` times, as one generation of one sample: n 1, seed + copy."""
    return replace(sp, n=1, seed=copy_seed(sp.seed, copy))


def _check_json_schema_text(text: str) -> None:
    """The cheap part of a schema's check (the grammar backend checks the rest when it compiles)."""
    import json

    try:
        schema = json.loads(text)
    except ValueError as e:
        raise ValueError(f"json_schema is not valid JSON: {e}") from None
    if not isinstance(schema, dict | bool):
        raise ValueError(f"json_schema must be a JSON object (a schema), got {type(schema).__name__}")
    cycle = _ref_only_cycle(schema)
    if cycle:
        raise ValueError(f"json_schema has a $ref at {cycle} that leads back to itself through references alone, "
                         "so no value matches it (a grammar of it cannot end)")


def _ref_only_cycle(schema: Any) -> str | None:
    """The location of a subschema that is nothing but a local `$ref` and whose references lead back to it
    without any schema on the way (`{"$ref": "#"}`, `a -> b -> a` in `$defs`), or None. A backend given one
    built a grammar with no way to end (fuzz audit 31: the request ended in an abort)."""
    from radixserve.interfaces.grammar import resolve_json_pointer  # not at the top: interfaces import this module

    def resolve(ref: str) -> Any:
        try:
            return resolve_json_pointer(schema, ref)
        except LookupError:  # a dangling reference is not a cycle (the backend names it)
            return None

    def only_ref(node: Any) -> str | None:
        if isinstance(node, dict) and isinstance(node.get("$ref"), str) and node["$ref"].startswith("#") and \
                set(node) <= {"$ref", "title", "description", "$comment", "examples", "default"}:
            return node["$ref"]
        return None

    stack = [(schema, "#")]
    while stack:
        node, where = stack.pop()
        if isinstance(node, dict):
            stack.extend((v, f"{where}/{k}") for k, v in node.items() if isinstance(v, dict | list))
        elif isinstance(node, list):
            stack.extend((v, f"{where}/{i}") for i, v in enumerate(node) if isinstance(v, dict | list))
        ref, seen = only_ref(node), {id(node)}
        while ref is not None:
            node = resolve(ref)
            if id(node) in seen:
                return where
            seen.add(id(node))
            ref = only_ref(node)
    return None


class ForwardMode(enum.Enum):
    """What a forward pass does. EXTEND covers prefill, chunked prefill and mixed batches
    (every request contributes >= 1 new token after a possibly cached prefix); DECODE is
    exactly one new token per request."""

    EXTEND = "extend"
    DECODE = "decode"
    IDLE = "idle"


@dataclass
class ForwardBatch:
    """Everything one forward pass needs. Built by the ModelRunner from a scheduled batch
    (`ModelRunner.prepare`), read by the model, the attention backend and the logits processor.

    Token layout: the new tokens of all requests are packed back to back (request i owns
    `extend_lens[i]` consecutive tokens); DECODE is the special case extend_lens == 1.
    KV layout: request i's KV slots are `req_to_token_pool.req_to_token[req_pool_indices[i], :seq_lens[i]]`;
    the first `prefix_lens[i]` of them are already filled; the model writes the new tokens' KV
    into `out_cache_loc` (which the scheduler also stored into req_to_token before the forward).
    """

    mode: ForwardMode
    batch_size: int
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    req_pool_indices: torch.Tensor  # [bs] int64, rows of ReqToTokenPool
    seq_lens: torch.Tensor  # [bs] int64, prefix + new tokens (length after this forward)
    prefix_lens: torch.Tensor  # [bs] int64, tokens whose KV is already in the pool
    extend_lens: torch.Tensor  # [bs] int64, new tokens in this forward
    out_cache_loc: torch.Tensor  # [num_tokens] int64, KV slots for the new tokens
    req_to_token_pool: ReqToTokenPool
    kv_pool: KVPool | LatentKVPool  # LatentKVPool for a latent-attention model (plugin API 1.4)
    attn_backend: AttentionBackend
    # host copies, so backends and samplers never sync the device to read lengths
    seq_lens_cpu: list[int] = field(default_factory=list)
    prefix_lens_cpu: list[int] = field(default_factory=list)
    extend_lens_cpu: list[int] = field(default_factory=list)
    # Speculative verify of tree drafts (None for every other forward): a flat bool tensor on the
    # batch's device holding, for each request i in order, a row-major [n_i, n_i] block
    # (n_i = extend_lens[i]); block[a, b] is True iff new token a may attend new token b (b is a
    # itself or one of its ancestors in the draft tree; token 0 is the root, the request's last
    # verified token). Every prefix token stays visible to every new token. Only backends with
    # `supports_tree_mask = True` receive it; a chain (or plain extend) never sets it.
    tree_mask: torch.Tensor | None = None
    tree_mask_cpu: list[list[list[bool]]] | None = None  # host copy: per request, the [n_i][n_i] block
    # per-backend metadata, set by AttentionBackend.init_forward_metadata; owned by the backend
    attn_metadata: Any = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


@dataclass(eq=False)
class Req:
    """One generation request inside the scheduler process.

    Created by the scheduler from a `GenerateRequest` message; fields below the line are written
    only by the scheduler and the prefix cache (the cache's rules are in PrefixCache's docstring)."""

    rid: str
    origin_input_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    priority: int = 0  # higher is admitted first by the `priority` policy
    # time.monotonic() seconds when the scheduler received it, strictly increasing in arrival order
    # (plugin API 1.15; before: an arrival counter 1, 2, ...)
    arrival_time: float = 0.0
    # ---- scheduler-owned -----------------------------------------------------------------
    output_ids: list[int] = field(default_factory=list)
    # tokens whose KV is (or is about to be) in the pool: origin_input_ids + output_ids at admission,
    # cut to the chunk end during chunked prefill
    fill_ids: list[int] = field(default_factory=list)
    req_pool_idx: int | None = None
    # KV slots of the cached prefix (owned by the prefix cache), int64 CPU tensor; set by match/lock
    prefix_indices: Any = None
    last_node: Any = None  # prefix-cache node locked for this request
    kv_len: int = 0  # tokens whose KV is in req_to_token[req_pool_idx]
    # free KV slots set aside for this request's next decode tokens, used front first (a run of
    # consecutive slots where memory allowed; a speculative verify returns its rejected drafts'
    # slots here); returned to the allocator when its KV is released
    decode_reserve: list[int] = field(default_factory=list)
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (reported in usage)
    finished_reason: dict | None = None  # e.g. {"type": "stop", "matched": 2} / {"type": "length"}
    retracted_count: int = 0
    # logprobs of each output token (when sampling_params.logprobs), and top alternatives
    output_token_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    # with sampling_params.prompt_logprobs: prompt token i+1's logprob (and alternatives) for each
    # prompt position i computed so far, in order (the first prompt token has none)
    prompt_token_logprobs: list[float] = field(default_factory=list)
    prompt_token_ranks: list[int] = field(default_factory=list)  # each one's rank in its distribution (1: likeliest)
    prompt_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    # the GrammarMatcher of a constrained request (json_schema/regex/ebnf), set once its grammar is
    # compiled; it has accepted exactly `output_ids`
    grammar: Any = None
    # with sampling_params.grammar_after: the compiled grammar waiting for its marker in the output
    # (radixserve.scheduler.grammar.DeferredGrammar); `grammar` is set when the marker is generated
    grammar_start: Any = None

    @property
    def finished(self) -> bool:
        return self.finished_reason is not None

    def all_ids(self) -> list[int]:
        return self.origin_input_ids + self.output_ids

    def kv_committed_ids(self) -> list[int]:
        """Tokens whose KV exists: everything except the newest sampled token (not yet forwarded)."""
        ids = self.all_ids()
        return ids[: self.kv_len]


@dataclass
class ScheduledBatch:
    """What the scheduler asks the ModelRunner to run (scheduler -> runner, same process).

    The scheduler has already allocated `out_cache_loc` from the TokenAllocator and written
    those slots into each request's ReqToTokenPool row at positions [prefix_len, prefix_len+extend_len).
    Requests appear in the same order in every list. Written by the scheduler, read by the runner."""

    mode: ForwardMode
    reqs: list[Req]
    input_ids: list[int]  # new tokens of all requests, packed
    req_pool_indices: list[int]
    prefix_lens: list[int]
    extend_lens: list[int]
    out_cache_loc: torch.Tensor  # int64 [sum(extend_lens)], CPU or device
    # False for a request whose prompt is not fully prefilled yet (an intermediate chunk):
    # the runner still runs it but does not sample a token for it
    sample_mask: list[bool] = field(default_factory=list)
    # overlap scheduling: a decode launched before the previous step's tokens reached the host takes
    # its input ids from that step's device output instead of `input_ids` (then empty)
    future_inputs: FutureTokens | None = None
    # speculative verify: request i's new tokens are its last verified token then its draft tokens;
    # the runner returns a token for every new token (BatchResult.spec_*) instead of one per request
    spec: SpecVerify | None = None
    # structured output: int32 [batch, ceil(vocab / 32)] CPU bitmask of allowed next tokens (row i
    # for request i; every bit set for unconstrained rows), and the grammar backend's function that
    # masks the logits with it (`GrammarBackend.apply_bitmask_inplace`); None when no row is constrained.
    # The scheduler fills the bitmask in a thread while the forward runs: call `token_bitmask_ready()`
    # (it waits, and re-raises a fill error) before reading `token_bitmask`, after queueing the forward,
    # on the thread that called `launch_batch` and before it returns: for a batch launched ahead
    # (`future_inputs`) it runs the scheduler's processing of the previous batch (its `result()`).
    # The buffer is reused two masked batches later: copy it (to the device) before this batch's
    # tokens are read, never keep it.
    token_bitmask: torch.Tensor | None = None
    apply_bitmask: Callable[[torch.Tensor, torch.Tensor], None] | None = None
    token_bitmask_ready: Callable[[], Any] | None = None
    # prompt logprobs (SamplingParams.prompt_logprobs): the packed token rows whose next prompt
    # token is scored, those tokens, and the most alternatives any row wants; None when no request asks
    prompt_logprob_rows: PromptLogprobRows | None = None

    @property
    def batch_size(self) -> int:
        return len(self.reqs)


@dataclass
class PromptLogprobRows:
    """Which hidden rows of an EXTEND batch the runner scores against the prompt (scheduler -> runner):
    row `rows[i]` (an index into the packed new tokens) predicts token `targets[i]`, the prompt's
    next token. The runner returns one logprob per row and `top` alternatives for each."""

    rows: list[int]
    targets: list[int]
    top: int = 0


@dataclass
class SpecVerify:
    """The draft structure of a verify batch (written by the scheduler, read by the runner).

    `parents[i][j]` is the parent (an index among request i's new tokens) of new token j; new
    token 0 is the request's last verified token, with parent -1. A chain has parents
    [-1, 0, 1, ...]. A new token sits at position prefix_len + its depth and attends its ancestors
    (and the prefix) only; when some request is not a chain the runner passes the tree mask to the
    attention backend (which must then have `supports_tree_mask`)."""

    parents: list[list[int]]

    @property
    def has_tree(self) -> bool:
        return any(any(p != j - 1 for j, p in enumerate(ps)) for ps in self.parents)


@dataclass
class FutureTokens:
    """Input ids not yet on the host: row `rows[i]` of the in-flight batch's sampled `tokens`.
    Written by the scheduler (overlap mode), read by the runner."""

    tokens: torch.Tensor  # [prev_bs] int64 on the runner's device: LaunchedBatch.token_ids
    rows: list[int]  # for each request of this batch, its row in `tokens`


class LaunchedBatch:
    """A batch whose forward and sampling are queued on the device but maybe not done
    (`ModelRunner.launch_batch`). `token_ids` can feed the next batch's `FutureTokens` at once;
    `result()` waits for the device and returns the host-side BatchResult (call it once).
    `done()`: True when `result()` would not wait (False when the runner cannot tell)."""

    def __init__(self, token_ids: torch.Tensor, resolve: Callable[[], BatchResult],
                 done: Callable[[], bool] | None = None) -> None:
        self.token_ids = token_ids  # [bs] int64 on the device; entries of unsampled rows are meaningless
        self._resolve = resolve
        self._done = done

    def result(self) -> BatchResult:
        return self._resolve()

    def done(self) -> bool:
        return self._done is not None and bool(self._done())


@dataclass
class BatchResult:
    """What the runner returns: one entry per request of the ScheduledBatch (None where
    sample_mask is False). Written by the runner, read by the scheduler."""

    next_token_ids: list[int | None]
    # logprob of each sampled token, and (token id, logprob) alternatives, when any request asked
    token_logprobs: list[float | None] | None = None
    top_logprobs: list[list[tuple[int, float]] | None] | None = None
    # speculative verify batches (ScheduledBatch.spec): per request, the target's own token after
    # each of its new tokens (argmax, or one draw from the processed distribution given the draft
    # path to that token), and their logprobs / alternatives when the request asked
    spec_token_ids: list[list[int]] | None = None
    spec_logprobs: list[list[float]] | None = None
    spec_top_logprobs: list[list[list[tuple[int, float]]]] | None = None
    # ScheduledBatch.prompt_logprob_rows: one logprob per scored row, its rank in the row's
    # distribution (tokens at least as likely, itself included: 1 for the likeliest, as vLLM counts)
    # and its `top` alternatives ((token id, logprob), best first), in the rows' order
    prompt_token_logprobs: list[float] | None = None
    prompt_token_ranks: list[int] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None


def tree_block(parents: list[int]) -> list[list[bool]]:
    """One request's block of `ForwardBatch.tree_mask`: `[n][n]`, row a True at a and at each of
    its ancestors (the new tokens it may attend).

    :param parents: per new token, its parent's index (-1 for the root, token 0); each parent
        comes before its children.

    Added in plugin API 1.4."""
    n = len(parents)
    block = [[False] * n for _ in range(n)]
    for a in range(n):
        b = a
        while b >= 0:
            block[a][b] = True
            b = parents[b]
    return block
