"""The scheduler loop body: admission, batch selection, KV accounting, result processing.

In-process and socket-free on purpose (the ZMQ wrapper is `runtime.scheduler_process`): tests drive it with
`add_request` / `abort` / `step()` against a toy runner.

Slot ownership (see PrefixCache): a request's row holds `prefix_indices` (the cache's, locked through
`last_node`) followed by its own slots up to `kv_len`. Every path that ends a request's residency
(finish, abort, retraction) goes through `cache.cache_finished_req` and then frees the row, so the
cache decides what to keep and nothing leaks.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from typing import Any

import torch

from radixserve.config import Config
from radixserve.interfaces import Drafter, PrefixCache, SchedulePolicy
from radixserve.interfaces.prefix_cache import match_result_problem
from radixserve.messages import GenerateRequest, ReqTokenOut
from radixserve.sampling.batch import sampling_reads_history
from radixserve.scheduler.failure_log import RepeatedFailureLog
from radixserve.scheduler.grammar import (
    DeferredGrammar,
    GrammarCompileError,
    GrammarService,
    constraint_of,
    grammar_timeout_refusal,
    tokenizer_fingerprint,
)
from radixserve.scheduler.metrics import SchedulerMetrics, StepTrace
from radixserve.scheduler.slot_audit import SlotAudit
from radixserve.scheduler.speculative.adaptive import DraftLengthControl
from radixserve.scheduler.speculative.drafts import Draft, accepted_path, check_proposal, checked_draft
from radixserve.scheduler.stop_strings import StopStringMatcher
from radixserve.state import (
    BatchResult,
    ForwardMode,
    FutureTokens,
    LaunchedBatch,
    PromptLogprobRows,
    Req,
    SamplingParams,
    ScheduledBatch,
    SpecVerify,
)
from radixserve.validation import ModelLimits, reject_reason

logger = logging.getLogger(__name__)

CLIP_MAX_NEW_TOKENS = 4096  # cap on one request's future-token reservation (long budgets rarely run out)
INIT_NEW_TOKEN_RATIO = 0.7  # fraction of max_new_tokens reserved at admission, decaying to MIN
MIN_NEW_TOKEN_RATIO = 0.14
NEW_TOKEN_RATIO_DECAY_STEPS = 600
PROMPT_TAIL = 5  # prompt ids used as decode context (leading spaces) by stop matching and the detokenizer
MODEL_FAILED = "the model failed while running this request (internal error; see the server log)"
CACHE_FAILED = "the prefix cache failed while running this request (internal error; see the server log)"
# decode slots set aside per request at a time: its decode tokens then sit together in the pool,
# which the CPU attention reads ~20% faster than one slot per request per step, 64 slots apart
DECODE_RUN = 16


@dataclass
class _Meta:
    """Per-request delivery state (not part of the runner contract, so kept off `Req`)."""

    stream: bool
    stop: list[str]
    stop_matcher: StopStringMatcher | None = None  # set when the request has stop strings
    sent: int = 0  # output tokens already emitted
    first_sent: bool = False
    spec_verify_ct: int = 0  # verify steps this request took part in with a draft
    spec_accepted_drafts: int = 0  # draft tokens accepted over those steps


@dataclass(frozen=True)
class FlushRefusal:
    """Why `flush_cache` changed nothing: the client's message and its HTTP status (400: requests are
    running, retry later; 500: a plugin broke the cache's contract)."""

    message: str
    status: int


@dataclass(frozen=True)
class _AdmissionBlock:
    """Where the last admission round stopped for lack of memory: `req` (the next request in the
    policy's order) needed `extend` new tokens plus its reserve, and the counters that change the
    queue were these. The lookahead decodes ahead while the same request still cannot fit."""

    req: Req
    extend: int
    arrivals: int
    retractions: int
    grammar_pending: int


@dataclass
class _Item:
    """One request's share of a batch."""

    req: Req
    prefix_len: int
    extend_len: int
    decode: bool  # a running request's one-token step (inside a DECODE or mixed batch)
    slots: torch.Tensor  # KV slots of the new tokens, already written into the request's row
    draft: Draft | None = None  # a verify step: the new tokens are the last token then these drafts
    # prompt logprobs: this item's new tokens from `scored_from` (an offset among them) on, `scored` of
    # them, predict a prompt token still to be scored (set when the batch is built)
    scored_from: int = 0
    scored: int = 0

    @property
    def completes_prompt(self) -> bool:
        return self.decode or self.prefix_len + self.extend_len == len(self.req.origin_input_ids) + len(
            self.req.output_ids
        )


def _prompt_logprob_rows(items: list[_Item]) -> PromptLogprobRows | None:
    """The rows of a prefill batch that score a prompt token (SamplingParams.prompt_logprobs): a new
    token at position j scores prompt token j + 1, from the first position not scored yet (positions
    before it were scored by an earlier chunk, or a run before a retraction). Sets each item's
    `scored_from` / `scored`; None when no request asks."""
    rows: list[int] = []
    targets: list[int] = []
    top = 0
    offset = 0
    for it in items:
        k = it.req.sampling_params.prompt_logprobs
        if k is not None and not it.decode:
            prompt = it.req.origin_input_ids
            # positions below len(prompt_token_logprobs) are scored already (by a run before a retraction:
            # admission kept no more prefix than that, so they are recomputed but not scored again); with
            # overlap scheduling the next chunk is built before this chunk's scores are stored, and its
            # prefix_len is the bound
            first = max(it.prefix_len, len(it.req.prompt_token_logprobs))
            last = min(it.prefix_len + it.extend_len, len(prompt) - 1)  # the last prompt token predicts no prompt token
            if first < last:
                it.scored_from, it.scored = first - it.prefix_len, last - first
                rows.extend(range(offset + it.scored_from, offset + it.scored_from + it.scored))
                targets.extend(prompt[first + 1 : last + 1])
                top = max(top, k)
        offset += it.extend_len
    return PromptLogprobRows(rows, targets, top) if rows else None


def _store_prompt_logprobs(items: list[_Item], result: BatchResult) -> None:
    """Append each item's scored rows (in `_prompt_logprob_rows`' order) to its request's prompt logprobs."""
    at = 0
    tops = result.prompt_top_logprobs
    for it in items:
        if not it.scored:
            continue
        req, k = it.req, it.req.sampling_params.prompt_logprobs
        position = it.prefix_len + it.scored_from
        for j in range(it.scored):
            if position + j == len(req.prompt_token_logprobs):  # in order; a position stored before is skipped
                req.prompt_token_logprobs.append(float(result.prompt_token_logprobs[at + j]))
                req.prompt_token_ranks.append(int(result.prompt_token_ranks[at + j]))
                req.prompt_top_logprobs.append(list(tops[at + j][:k]) if tops is not None and k else [])
        at += it.scored


def _appends_sampled_token(it: _Item) -> bool:
    """Whether `_process` appends the row's one sampled token with `_append_token` (which advances
    the request's matcher, if it has one): the request is live, the row completes its prompt (an
    intermediate prefill chunk samples nothing), it is no verify row (`_apply_verify` appends
    those) and the request may produce tokens (max_new_tokens 0 ends without one). One predicate
    for `_process` and `_accept_grammar_tokens`, which advances the matchers ahead of it."""
    req = it.req
    return (not req.finished and it.completes_prompt and it.draft is None
            and req.sampling_params.max_new_tokens != 0)


def _allow_all(bitmask: torch.Tensor, rows: set[int]) -> None:
    """Every token allowed in these rows of a step's bitmask (rows no matcher fills)."""
    if rows:
        bitmask[sorted(rows)] = -1


def _started(pool: ThreadPoolExecutor, fn: Callable[..., Any], *args: Any) -> Future:
    """`pool.submit(fn, *args)`, returning once the pool's thread runs it. A woken thread needs the
    GIL, which this thread keeps while it runs Python until it blocks or CPython's switch interval
    (5 ms) ends: a mask fill submitted before the previous step's processing would only start
    after it (the H200 timeline showed exactly that). Once inside `fn` (xgrammar's fill releases
    the GIL) the two run side by side. Never waits longer than one switch interval."""
    started = threading.Event()

    def run() -> Any:
        started.set()
        return fn(*args)

    fut = pool.submit(run)
    started.wait(sys.getswitchinterval())
    return fut


class _PrevStep:
    """The in-flight step during the launch of the decode that follows it: `process()` (once)
    waits for its tokens and processes them. A constrained batch launched ahead calls it from its
    `token_bitmask_ready` (its mask needs those tokens); otherwise the scheduler calls it after the
    launch. `finish(items, result)` is the scheduler's handling of a finished step's tokens.
    `early`: the mask thread's accept of this step's tokens and fill of the next mask, started
    before the next batch's launch when these tokens were already on the host (`_bitmask_after`)."""

    def __init__(self, step: tuple[list[_Item], LaunchedBatch],
                 finish: Callable[..., None]) -> None:
        self._step = step
        self._finish = finish
        self.done = False
        self._result: BatchResult | None = None
        self.early: Future | None = None  # -> (accepted, filled rows, fill error or None)

    @property
    def items(self) -> list[_Item]:
        return self._step[0]

    def tokens_on_host(self) -> bool:
        """Whether `result()` returns without waiting for the device."""
        return self._result is not None or self._step[1].done()

    def result(self) -> BatchResult:
        """The step's tokens (the first call waits for the device)."""
        if self._result is None:
            self._result = self._step[1].result()
        return self._result

    def early_accepted(self) -> dict[int, tuple[bool, bool]] | None:
        """What the early accept returned (waits for it), or None when there was none."""
        return None if self.early is None else self.early.result()[0]

    def process(self, on_accepted: Callable[[set[int]], None] | None = None,
                accepted: dict[int, tuple[bool, bool]] | None = None) -> None:
        """`on_accepted`, `accepted`: passed to the scheduler's `_process` (`on_accepted` is called
        once the matchers accepted the step's tokens, before the rest of the per-request work;
        `accepted`: they already did, in the early accept)."""
        if self.done:
            return
        self.done = True
        items, result = self.items, self.result()
        self.drop()
        # called inside the runner's launch (inference mode): tensors made here live on, as usual
        with torch.inference_mode(False):
            self._finish(items, result, on_accepted, accepted)

    def drop(self) -> None:
        """Forget the step once processed. The next batch (its mask's ready()) keeps this object
        and the runner's result closure keeps that batch: holding the step here would chain every
        batch launched ahead to the one before it, keeping all their tensors and pinned result
        buffers alive (a new pinned allocation per step, ever more objects for the GC to scan)."""
        self._step, self._result = None, None


class Scheduler:
    """Continuous batching over one ModelRunner.

    Contract:
    - `add_request(msg)` queues a request, or rejects it (an output with `error`) when it can never
      fit: prompt + max_new_tokens above the KV pool or the context length, or an empty prompt.
    - `step()` runs at most one forward (a prefill/extend batch when one can be formed, else a decode
      of the running requests) and returns the outputs to send to the detokenizer.
    - `abort(rid)` ends a waiting or running request (finish_reason {"type": "abort"}).
    - A stop string ends its request on the step its text appears (finish_reason {"type": "stop",
      "matched": <string>}, counted as finished, KV released at once); the tokens that make up the
      stop string are sent last as `num_stop_tokens` (for the text cut) with no logprobs (with
      `no_stop_trim` they are returned with their logprobs, and the text keeps the string). While a
      streamed request's text ends in a possible stop-string prefix, those tokens are held back.
    - `flush_cache()` empties the prefix cache when no request is resident (returns False otherwise);
      afterwards `allocator.available_size() == allocator.size`. `flush_refusal()` does the same and
      says why it did not (None when it flushed).
    - Speculative decoding (`drafter` given, from `stack.speculative`): the decode step of the
      running requests becomes a verify step (`_verify_items`): each request's last token plus its
      drafts in one EXTEND forward (`ScheduledBatch.spec`), the longest path of drafts equal to
      the target's own tokens is appended (cut where the request finishes), the kept nodes' slots
      stay in its row, the others go back to its decode reserve. Overlap is off with a drafter.
    Greedy outputs do not depend on batching, chunking, cache hits, retraction, overlap or
    speculation.
    - A prefix cache that breaks slot ownership is named in the log (`cache_label`), once per kind
      (`SlotAudit`: locks or leaked slots with nothing resident, free + cached above the pool, a
      leak after a flush). A request-level cache call that raises (a double free under
      `scheduler.debug_kv_checks`) ends that request with a 500; an `evict` that raises frees
      nothing more, and a request it leaves unable to be admitted ends with a 500.

    Overlap (`overlap=True`): `step()` launches the next batch before it processes the previous one,
    so host work (result processing, emitting, the next batch's preparation) runs while the device
    computes. Only a decode that continues a decode is launched ahead (also while requests wait for
    a running slot): its input tokens are the in-flight batch's device output (`FutureTokens`).
    Anything else (admission, chunks, retraction, penalties that read the token history) first
    waits for the in-flight batch. A decode with constrained rows is launched ahead too: the
    in-flight batch is processed (the matchers accept its tokens) inside the new batch's
    `token_bitmask_ready`, which the runner calls after queueing the forward and before sampling,
    and then its bitmask is filled. A request that
    stops on EOS in step N has already been launched in step N+1; that extra token is dropped.
    Between steps `req.kv_len` counts every KV slot assigned to the request, launched or done.

    Structured output (`grammar`, a GrammarService; None: constrained requests are rejected): a
    request with a json_schema/regex/ebnf constraint waits in the queue, without holding up the
    others, until its grammar is compiled (a compile error ends it with a 400); each step the
    scheduler fills a token bitmask for its row (`ScheduledBatch.token_bitmask`, in a thread while
    the forward runs; with overlap, after the previous step's processing, see above), the runner
    masks the logits with it, and the sampled token is accepted into the request's matcher; when the
    matcher terminates the request ends (finish reason "stop").
    """

    def __init__(
        self,
        config: Config,
        runner: Any,
        cache: PrefixCache,
        policy: SchedulePolicy,
        tokenizer: Any = None,
        *,
        drafter: Drafter | None = None,
        grammar: GrammarService | None = None,
        cache_label: str | None = None,
        policy_label: str | None = None,
        drafter_label: str | None = None,
    ) -> None:
        sc = config.scheduler
        self.grammar_compile_timeout_s = config.stack.grammar_compile_timeout_s
        self.runner = runner
        self._tokenizer = tokenizer  # for stop strings; the runner's (loaded on first use) when None
        self.cache = cache
        # how log lines name the cache (from_config: its stack name and distribution)
        self.cache_label = cache_label or f"prefix cache {type(cache).__name__}"
        self.policy = policy
        self.policy_label = policy_label or f"policy {type(policy).__name__}"
        self.drafter_label = drafter_label or f"drafter {type(drafter).__name__}"
        self.req_to_token_pool = runner.req_to_token_pool
        self.allocator = runner.token_allocator
        self.context_len = int(runner.context_len)
        self.eos_token_ids = frozenset(getattr(runner, "eos_token_ids", ()) or ())
        self.limits = ModelLimits(vocab_size=int(getattr(runner, "vocab_size", 0) or 0), context_len=self.context_len)
        device = str(getattr(runner, "device", "cpu"))
        self.chunk_size = sc.resolved_chunked_prefill_size(device)
        self.max_prefill_tokens = sc.max_prefill_tokens
        self.max_running = min(sc.max_running_requests, self.req_to_token_pool.size)
        self.enable_mixed = sc.resolved_enable_mixed_chunk(device, speculative=drafter is not None)
        self.interleave_decode = sc.interleave_decode  # a decode step between any two prefill batches
        self.in_batch_prefix = sc.in_batch_prefix_threshold if cache.shares_prefixes else 0
        self.stream_interval = sc.stream_interval
        self._failures = RepeatedFailureLog(logger)  # plugin hooks that may fail on every step
        self._slot_audit = SlotAudit(logger, self.cache_label, self.allocator, cache)
        self._evict_failed = False  # set by _evict when the cache's evict raised
        cons = sc.schedule_conservativeness
        self.init_ratio = min(1.0, INIT_NEW_TOKEN_RATIO * cons)
        self.min_ratio = min(self.init_ratio, MIN_NEW_TOKEN_RATIO * cons)
        self.ratio_decay = (self.init_ratio - self.min_ratio) / NEW_TOKEN_RATIO_DECAY_STEPS
        self.new_token_ratio = self.init_ratio

        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.chunked_req: Req | None = None  # a prompt prefilled over several steps (one at a time)
        self._decode_turn = False  # alternate chunk steps with decode steps so decodes keep running
        self.meta: dict[str, _Meta] = {}
        self.metrics = SchedulerMetrics()
        self.step_trace = StepTrace.from_env()
        # overlap only: when the step whose tokens arrive next began to own the device (the previous
        # step's tokens arriving, or its own launch onto an idle device); see _trace_overlapped
        self._trace_mark = 0.0
        self._outbox: list[ReqTokenOut] = []
        self._arrivals = 0
        self._last_arrival_time = 0.0  # arrival_time of the newest request (kept strictly increasing)
        self._share_refused_at = -1  # _arrivals when a shared chunk admitted nobody (see _prefill_items)
        self._evicted = False  # set by _alloc_slots when it evicted from the cache
        self.overlap = config.runtime.resolved_overlap(device)
        # speculative decoding (docs/speculative.md): a verify step replaces the plain decode step
        self.drafter = drafter
        spec = config.speculative
        self.draft_control = DraftLengthControl(spec.num_draft_tokens, spec.adaptive_batch_size, spec.min_accepted_drafts)
        self.trees_ok = bool(getattr(runner, "supports_tree_mask", False))
        if drafter is not None and spec.topk > 1:  # say which happens: nothing else shows it
            backend = type(getattr(runner, "attn_backend", runner)).__name__
            if self.trees_ok:
                logger.info("speculative.topk=%d: draft trees are verified with tree masks (attention %s)",
                            spec.topk, backend)
            else:
                logger.warning("speculative.topk=%d asks for draft trees, but the attention backend %s does not "
                               "verify them (supports_tree_mask is False): each tree is cut to the chain of each node's "
                               "first child", spec.topk, backend)
        self._step_acceptance: list[int] = []  # per verify step: accepted drafts of each drafting request
        self._invalid_drafts_logged = False  # the first draft token dropped for breaking the contract is logged
        if drafter is not None and self.overlap:
            logger.info("speculative decoding is on: overlap scheduling is switched off (verify steps run one at a time)")
            self.overlap = False
        self._in_flight: tuple[list[_Item], LaunchedBatch] | None = None  # overlap: launched, not processed
        self._admission_block: _AdmissionBlock | None = None  # set by _prefill_items, read by _lookahead_decode
        # requests of a batch whose forward raised: each runs alone until it passes (or fails alone)
        self._suspects: set[str] = set()
        self.grammar = grammar
        # rid -> (its compiled-grammar future, the request, which waits in `waiting` until it is done)
        self._grammar_pending: dict[str, tuple[Future, Req]] = {}
        self._mask_pool: ThreadPoolExecutor | None = None  # fills token bitmasks while forwards run
        self._pin_bitmasks = str(getattr(runner, "device", "cpu")).startswith("cuda")
        self._bitmask_bufs: list[torch.Tensor | None] = [None, None]  # see _new_bitmask
        # overlap: fill a launched-ahead batch's mask in the mask thread beside the rest of the previous
        # step's processing; with few cores the thread hand-offs cost more than the overlap saves
        self.fill_beside_processing = len(os.sched_getaffinity(0)) >= 4 if hasattr(os, "sched_getaffinity") else False
        self._bitmask_turn = 0
        # with fill_beside_processing: when the previous step's tokens are already on the host as the
        # next decode is launched (the host is the slower side), the mask thread accepts them and
        # fills the next mask while this thread prepares and launches that decode (_bitmask_after)
        self.fill_before_launch = True

    @classmethod
    def from_config(cls, config: Config, runner: Any, registry: Any, tokenizer: Any = None) -> Scheduler:
        """Build with the prefix cache (with `stack.prefix_cache_options`) and policy (with `stack.policy_options`) named in
        `config.stack`, loaded from `registry` (the process's, see Registry.from_config).
        `tokenizer`: for stop strings (None: the runner's)."""
        name = config.stack.prefix_cache
        cache_cls = registry.load("prefix_cache", name)
        policy_cls = registry.load("policy", config.stack.policy)
        from radixserve.plugins.stack import build_prefix_cache

        cache = build_prefix_cache(config, registry, cache_cls, runner.req_to_token_pool, runner.token_allocator)
        label = f"prefix cache {name!r} ({registry.get('prefix_cache', name).distribution})"
        policy_label = f"policy {config.stack.policy!r} ({registry.get('policy', config.stack.policy).distribution})"
        from radixserve.scheduler.speculative.setup import build_drafter

        policy = policy_cls(**config.stack.policy_options)
        drafter = build_drafter(config, runner, registry)
        spec = config.stack.speculative
        drafter_label = f"drafter {spec!r} ({registry.get('drafter', spec).distribution})" if drafter is not None else None
        grammar = grammar_service(config, runner, registry, tokenizer)
        return cls(config, runner, cache, policy, tokenizer, drafter=drafter, grammar=grammar, cache_label=label,
                   policy_label=policy_label, drafter_label=drafter_label)

    # ---- requests in ------------------------------------------------------------------------
    def add_request(self, msg: GenerateRequest) -> None:
        sp = msg.sampling_params
        ids = list(msg.input_ids)
        err = self._reject_reason(ids, sp)
        if err is not None or msg.rid in self.meta:
            err = err or f"request id {msg.rid!r} is already in use"
            logger.debug("request %s refused: %s", msg.rid, err)
            self.metrics.rejected_requests += 1
            self._outbox.append(ReqTokenOut(rid=msg.rid, new_ids=[], error=err))
            return
        self._arrivals += 1
        # monotonic seconds, strictly increasing: a policy may both compare and age them
        self._last_arrival_time = max(time.monotonic(), self._last_arrival_time + 1e-6)
        req = Req(
            rid=msg.rid,
            origin_input_ids=ids,
            sampling_params=sp,
            eos_token_ids=frozenset() if sp.ignore_eos else self.eos_token_ids,
            priority=msg.priority,
            arrival_time=self._last_arrival_time,
        )
        req.fill_ids = list(ids)
        constraint = constraint_of(sp)
        if constraint is not None:
            if self.grammar is None:
                self.metrics.rejected_requests += 1
                self._outbox.append(ReqTokenOut(rid=msg.rid, new_ids=[], error=(
                    f"{constraint[0]}: structured output needs a grammar backend and this server has none; "
                    "install one (pip install radixserve-grammar-xgrammar) or set stack.grammar"
                )))
                return
            self._grammar_pending[req.rid] = (self.grammar.compile(*constraint), req)
        self.meta[req.rid] = _Meta(stream=msg.stream, stop=list(sp.stop), stop_matcher=self._stop_matcher(req))
        self.waiting.append(req)
        logger.debug("request %s queued: %d prompt tokens, max_new_tokens %s, priority %s%s; %d waiting", req.rid,
                     len(ids), sp.max_new_tokens, msg.priority, f", constraint {constraint[0]}" if constraint else "",
                     len(self.waiting))

    def _poll_grammars(self) -> None:
        """Give each request whose grammar is compiled its matcher; end those whose grammar failed."""
        now = time.monotonic()
        for rid, (fut, req) in list(self._grammar_pending.items()):
            # its wait counts from its arrival (req.arrival_time: monotonic seconds, taken when it was added)
            if not fut.done() and now < req.arrival_time + self.grammar_compile_timeout_s:
                continue
            del self._grammar_pending[rid]  # (an abort while compiling removed its entry already)
            if not fut.done():  # the compile goes on in its thread (cached for later requests); this one ends
                kind, _ = constraint_of(req.sampling_params)
                self._refuse_waiting(req, *grammar_timeout_refusal(kind, fut, self.grammar_compile_timeout_s))
                continue
            try:
                compiled = fut.result()
                after = req.sampling_params.grammar_after
                if after:  # e.g. after the reasoning section: the matcher starts when it is generated
                    req.grammar_start = DeferredGrammar(compiled, after, self._tokenizer_or_runners(),
                                                        req.origin_input_ids[-PROMPT_TAIL:])
                else:
                    req.grammar = self.grammar.ready_backend.new_matcher(compiled)
            except GrammarCompileError as e:
                self._refuse_waiting(req, e.message, e.status)
            except Exception as e:  # a backend bug: this request fails, the server goes on
                logger.exception("grammar for request %s failed", rid)
                self._refuse_waiting(req, f"the grammar backend failed: {e!r}", 500)

    def _refuse_waiting(self, req: Req, message: str, status: int = 400) -> None:
        self.waiting.remove(req)
        self.meta.pop(req.rid, None)
        self.metrics.rejected_requests += 1
        self._outbox.append(ReqTokenOut(rid=req.rid, new_ids=[], error=message, error_status=status))

    def _wait_for_grammars(self, timeout: float = 0.02) -> None:
        """Nothing could run: block briefly on the compiles instead of spinning the loop."""
        if self._grammar_pending:
            wait_futures([fut for fut, _ in self._grammar_pending.values()], timeout=timeout,
                         return_when=FIRST_COMPLETED)

    def _tokenizer_or_runners(self) -> Any:
        if self._tokenizer is None:
            self._tokenizer = self.runner.tokenizer
        return self._tokenizer

    def _stop_matcher(self, req: Req) -> StopStringMatcher | None:
        sp = req.sampling_params
        if not any(sp.stop):
            return None
        return StopStringMatcher(
            self._tokenizer_or_runners(), sp.stop, req.origin_input_ids[-PROMPT_TAIL:], sp.skip_special_tokens
        )

    def _reject_reason(self, ids: list[int], sp: SamplingParams) -> str | None:
        """A defensive re-check of what the API edge validated (radixserve.validation): an id
        outside the vocabulary would fail inside the embedding; plus the KV capacity, known only here."""
        err = reject_reason(ids, sp, self.limits)
        if err is not None:
            return err
        need = len(ids) + sp.max_new_tokens
        if need > self.allocator.size:
            return (
                f"the prompt ({len(ids)} tokens) plus max_new_tokens ({sp.max_new_tokens}) exceeds the KV cache "
                f"capacity ({self.allocator.size} tokens); lower max_new_tokens or raise scheduler.max_total_tokens"
            )
        return None

    def abort(self, rid: str) -> bool:
        """End request `rid` wherever it is; False when it is unknown (already finished)."""
        req = next((r for r in self.waiting if r.rid == rid), None)
        if req is not None:
            self.waiting.remove(req)
            self._grammar_pending.pop(rid, None)
        elif self.chunked_req is not None and self.chunked_req.rid == rid:
            req, self.chunked_req = self.chunked_req, None
            self._release(req)
        else:
            req = next((r for r in self.running if r.rid == rid), None)
            if req is None:
                if self._in_flight is not None and any(it.req.rid == rid for it in self._in_flight[0]):
                    # its prefill is in flight (overlap): the request joins `running` (or ends)
                    # when that step is processed; do it now, then end it where it landed
                    self._finish_in_flight()
                    return self.abort(rid)
                return False
            self.running.remove(req)
            self._release(req)
        req.finished_reason = {"type": "abort"}
        logger.debug("request %s aborted after %d output tokens", rid, len(req.output_ids))
        self.metrics.aborted_requests += 1
        self._emit(req, force=True)
        self._drafter_forget(req)
        return True

    def flush_cache(self) -> bool:
        return self.flush_refusal() is None

    def flush_refusal(self) -> FlushRefusal | None:
        """Empty the prefix cache; None when done, else why not: nothing was changed, or (a 500 naming the
        leak) the cache was emptied but KV slots it leaked are still not free."""
        self._finish_in_flight()
        if self.waiting or self.running or self.chunked_req is not None:
            # a prompt being prefilled in chunks counts as running (long-context audit 34: "0 running, 0 waiting")
            running = len(self.running) + (self.chunked_req is not None)
            return FlushRefusal(f"cannot flush the cache while requests are running ({running} running, "
                                f"{len(self.waiting)} waiting); retry when idle", 400)
        locked = self.cache.protected_size()
        if locked:  # no request holds a lock now: a plugin leaked one (reset would refuse or leak)
            return FlushRefusal(
                f"{self.cache_label} still holds {locked} locked KV slots with no request running, so it cannot be "
                "flushed: a lock was never released (the cache's cache_finished_req, or a schedule policy that locked "
                "a node: docs/contracts.md sections 2 and 4); restart the server to recover the slots", 500)
        try:
            self.cache.reset()
        except Exception as e:
            logger.exception("%s: reset() failed; the cache was not flushed", self.cache_label)
            return FlushRefusal(f"{self.cache_label} failed to reset: {type(e).__name__}: {e}; the cache was not "
                                "flushed (a plugin error, logged)", 500)
        stuck = self._slot_audit.after_reset()
        if stuck:  # the cache is empty, yet slots stay taken: "ok" would tell the operator the memory is back
            return FlushRefusal(
                f"{self.cache_label} was emptied, but {stuck} of {self.allocator.size} KV slots are still not free: "
                "the cache leaked them (it must free every slot it does not keep: docs/contracts.md section 1); "
                "restart the server to recover the slots", 500)
        return None

    def has_work(self) -> bool:
        return bool(
            self.waiting or self.running or self.chunked_req is not None or self._outbox or self._in_flight is not None
        )

    # ---- one iteration ----------------------------------------------------------------------
    def step(self) -> list[ReqTokenOut]:
        start = time.perf_counter()
        if self._grammar_pending:
            self._poll_grammars()
        ran = self.has_work()
        if self.overlap:
            self._step_overlapped()
        else:
            items = self._schedule()
            ran = bool(items)
            if not items:
                self._wait_for_grammars()
            if items:
                try:
                    sb = self._to_scheduled_batch(items)
                    forward_start = time.perf_counter()
                    result = self.runner.launch_batch(sb).result()
                    forward_seconds = time.perf_counter() - forward_start
                    self.metrics.forward_seconds += forward_seconds
                    if self.step_trace is not None:
                        self.step_trace.record(forward_start, sum(it.decode for it in items),
                                               sum(it.extend_len for it in items if not it.decode), forward_seconds)
                except Exception:
                    self._isolate_failure([items])
                else:
                    self._finish_step(items, result)
        self.metrics.record_step()
        if ran:  # an idle step (nothing scheduled) is waiting, not work
            self.metrics.steps += 1
            self.metrics.step_seconds += time.perf_counter() - start
        # three counters; the idle checks need no request holding KV (waiting ones hold none)
        self._slot_audit.after_step(not self.running and self.chunked_req is None and self._in_flight is None)
        outs, self._outbox = self._outbox, []
        return outs

    def _step_overlapped(self) -> None:
        prev, self._in_flight = self._in_flight, None
        if prev is not None:
            ahead = None
            prev_step = _PrevStep(prev, self._finish_step)
            try:
                ahead = self._lookahead_decode(prev)
                if ahead is not None:
                    items, future = ahead
                    sb = self._to_scheduled_batch(items, future, prev_step)
                    self._in_flight = (items, self.runner.launch_batch(sb))
                # a constrained ahead batch already processed prev, before its sampling
                result = None if prev_step.done else prev_step.result()
                accepted = None if prev_step.done else prev_step.early_accepted()
            except Exception:  # the ahead batch reads prev's tokens: both are untrusted
                self._settle_early(prev_step)
                self._isolate_failure([prev[0]] + ([ahead[0]] if ahead is not None else []))
                return
            prev_step.drop()
            if result is not None:  # the device is busy with the next batch meanwhile
                self._finish_step(prev[0], result, accepted=accepted)
            if ahead is not None:
                return
        items = self._schedule()
        if not items and prev is None:
            self._wait_for_grammars()
        if items:
            try:
                self._trace_mark = time.perf_counter()  # nothing in flight: the device was idle
                self._in_flight = (items, self.runner.launch_batch(self._to_scheduled_batch(items)))
            except Exception:
                self._isolate_failure([items])

    # ---- failure isolation --------------------------------------------------------------------
    def _isolate_failure(self, batches: list[list[_Item]]) -> None:
        """A forward (or its sampling) raised. Whatever caused it, one request must not take the
        others down: the batches' new KV slots are freed (their contents cannot be trusted), each
        request goes back to the waiting queue as a suspect holding only the KV it had before, and
        suspects then run alone (`_schedule`). A suspect that fails alone is ended with an error
        (HTTP 500); the others finish normally, with the same outputs."""
        logger.exception("a batch of %d request(s) failed; isolating the cause", sum(len(b) for b in batches))
        self._in_flight = None
        kept_prefix: dict[int, int] = {}
        reqs: dict[int, Req] = {}
        for it in (it for batch in batches for it in batch):
            if it.req.finished:  # aborted or stopped while in flight: its slots were released with it
                continue
            self.allocator.free(it.slots)
            key = id(it.req)
            reqs[key] = it.req
            kept_prefix[key] = min(kept_prefix.get(key, it.prefix_len), it.prefix_len)
        alone = len(reqs) == 1
        for key, req in reqs.items():
            req.kv_len = kept_prefix[key]
            if req in self.running:
                self.running.remove(req)
            if req is self.chunked_req:
                self.chunked_req = None
            if alone and req.rid in self._suspects:
                self._fail(req)
            else:
                self._suspects.add(req.rid)
                self._retract(req)

    def _finish_step(self, items: list[_Item], result: BatchResult, on_accepted=None, accepted=None) -> None:
        """A launched step's tokens: clear a suspect that ran alone, then process them."""
        if self.overlap and self.step_trace is not None:
            self._trace_overlapped(items)
        self._passed(items)
        self._process(items, result, on_accepted, accepted)

    def _trace_overlapped(self, items: list[_Item]) -> None:
        """The step trace under overlap, where a forward's own time is not observable from the host:
        a step is charged from the mark (the previous step's tokens arriving, or its launch onto an
        idle device) to its own tokens arriving. While the device is the bottleneck that is the
        device time of the step; while the host is, it includes the host work the step waited for."""
        now = time.perf_counter()
        self.step_trace.record(self._trace_mark, sum(it.decode for it in items),
                               sum(it.extend_len for it in items if not it.decode), now - self._trace_mark)
        self._trace_mark = now

    def _settle_early(self, prev_step: _PrevStep) -> None:
        """A launch failed after the early accept took `prev_step`'s tokens into the matchers: append
        those tokens as well (as when the failure comes after its mask's ready() processed them),
        so that outputs and matchers agree before the batches are isolated."""
        early = prev_step.early
        if early is None or prev_step.done:
            return
        wait_futures([early])
        if early.exception() is not None:
            return
        try:
            prev_step.process(accepted=early.result()[0])
        except Exception:
            logger.exception("processing the step before a failed launch failed")

    def _passed(self, items: list[_Item]) -> None:
        """A suspect whose prompt ran through alone is cleared."""
        if self._suspects and len(items) == 1 and items[0].completes_prompt:
            self._suspects.discard(items[0].req.rid)

    def _fail(self, req: Req) -> None:
        self._release(req)
        self._end_failed(req, MODEL_FAILED)

    def count_failed_admission(self) -> None:
        """A request whose admission raised (the scheduler process answers it with a 500): counted
        in failed_requests as every other 500 (chaos audit 32: it was not)."""
        self.metrics.failed_requests += 1

    def _end_failed(self, req: Req, error: str) -> None:
        """End a request that holds no KV any more with an internal error (HTTP 500)."""
        self._suspects.discard(req.rid)
        req.finished_reason = {"type": "abort", "message": "internal error"}
        self.metrics.failed_requests += 1
        self.meta.pop(req.rid, None)
        self._drafter_forget(req)
        self._outbox.append(ReqTokenOut(rid=req.rid, new_ids=[], error=error, error_status=500))

    def _own_from(self, req: Req) -> int | None:
        """The first row position of the request's own slots before a request-level cache call: past
        its cached prefix (`prefix_indices`, the cache's), or 0 for a cache that never shares (it owns
        nothing; the prefix of its next chunk is the request's). None when that cannot be told."""
        if not getattr(self.cache, "shares_prefixes", True):
            return 0
        try:
            return 0 if req.prefix_indices is None else int(req.prefix_indices.numel())
        except Exception:
            return None

    def _cache_failed(self, call: str, req: Req, own_from: int | None = None) -> None:
        """A request-level cache call raised (e.g. its insert, or the allocator's double-free check under
        scheduler.debug_kv_checks): the scheduler returns the request's own slots itself
        (`_reclaim_own_slots`), unlocks `req.last_node` and frees its decode slots and row; the caller
        ends the request with a 500. `own_from`: `_own_from(req)` taken before the call."""
        self._failures.exception(f"{self.cache_label}: {call} raised; the request ends with an internal error (500)")
        logger.error("%s: %s failed for request %s", self.cache_label, call, req.rid)
        self._reclaim_own_slots(call, req, own_from)
        try:  # the helpers free before they move the lock (contracts.md section 2): most likely still this one
            self.cache.dec_lock_ref(req.last_node)
        except Exception:
            logger.debug("%s: dec_lock_ref after the failure failed too", self.cache_label, exc_info=True)
        self._free_decode_reserve(req)
        if req.req_pool_idx is not None:
            self.req_to_token_pool.free(req.req_pool_idx)
        req.req_pool_idx, req.last_node = None, None

    def _reclaim_own_slots(self, call: str, req: Req, own_from: int | None) -> None:
        """After `call` raised for `req`: free the slots at row positions `[own_from, kv_len)` (the
        request's own before the call) that the cache did not take or free. The cache's share is what
        `match_prefix` of the request's tokens reports (an insert before the failure took those); a slot
        the allocator already counts free (the cache freed a duplicate) is not freed again. When
        ownership cannot be told (match_prefix fails too, an allocator without `is_free`), nothing is
        freed: a leak, which the slot audit names, rather than a slot handed out twice."""
        if req.req_pool_idx is None or own_from is None or req.kv_len <= own_from:
            return
        key = req.all_ids()[: req.kv_len]
        try:
            own = self.req_to_token_pool.read(req.req_pool_idx, req.kv_len, own_from)
            m = self._checked_match(key)
            own = own[(own >= 1) & (own <= self.allocator.size)].unique()
            keep = torch.isin(own, m.kv_indices) | self.allocator.is_free(own)
            back = own[~keep]
            self.allocator.free(back)
        except Exception as e:
            logger.error("%s: after %s raised, the KV slots of request %s could not be told apart from the cache's "
                         "(%r): up to %d slots stay allocated (leaked)", self.cache_label, call, req.rid, e,
                         req.kv_len - own_from)
            return
        logger.debug("%s: after %s raised, %d of request %s's %d own KV slots went back to the pool (the rest are "
                     "the cache's or it freed them)", self.cache_label, call, int(back.numel()), req.rid,
                     req.kv_len - own_from)

    def _finish_in_flight(self) -> None:
        if self._in_flight is not None:
            items, launched = self._in_flight
            self._in_flight = None
            self._process(items, launched.result())

    def _lookahead_decode(self, prev: tuple[list[_Item], LaunchedBatch]) -> tuple[list[_Item], FutureTokens] | None:
        """The decode step after the in-flight decode `prev`, launchable before prev's tokens are
        known; None when the next batch needs them (or something else) first."""
        prev_items, launched = prev
        if self.chunked_req is not None or not all(it.decode for it in prev_items):
            return None

        reqs, rows = [], []
        live = ending_slots = 0
        for i, it in enumerate(prev_items):
            req = it.req
            if req.finished:  # aborted while in flight
                continue
            live += 1
            n_out = len(req.output_ids) + 1  # counting the in-flight token
            if n_out >= req.sampling_params.max_new_tokens or len(req.origin_input_ids) + n_out >= self.context_len:
                ending_slots += req.kv_len + 1  # its in-flight token is its last: its slots turn evictable
                continue
            if sampling_reads_history(req):
                return None  # its next row needs the in-flight token on the host
            reqs.append(req)
            rows.append(i)
        if not reqs or live != len(self.running):
            return None
        if self.waiting and len(self.running) < self.max_running and not self._admission_blocked(ending_slots):
            return None  # a waiting request may be admitted now: schedule with prev's results
        slots = self._decode_slots(reqs)
        if slots is None:
            return None
        self._write_rows(reqs, slots)
        self.new_token_ratio = max(self.min_ratio, self.new_token_ratio - self.ratio_decay)
        items = [_Item(req, req.kv_len, 1, True, slots[i : i + 1]) for i, req in enumerate(reqs)]
        self.metrics.overlapped_batches += 1
        return items, FutureTokens(tokens=launched.token_ids, rows=rows)

    def _admission_blocked(self, ending_slots: int) -> bool:
        """Whether admission would stop again where it last stopped for memory: nothing arrived, was
        retracted or finished compiling its grammar since, and the room (free + evictable slots, plus
        `ending_slots` of requests whose in-flight token is their last, minus the running requests'
        reserve) is still short of that request's need. The room only grows as requests finish, so
        admission is tried again as soon as it could succeed; until then a memory-bound queue does not
        keep the next decode from being launched ahead."""
        b = self._admission_block
        if (b is None or b.req.finished or self._suspects or b.arrivals != self._arrivals
                or b.retractions != self.metrics.retractions or b.grammar_pending != len(self._grammar_pending)):
            return False
        reserved = sum(self._future_tokens(r) for r in self.running)
        room = self.allocator.available_size() + self.cache.evictable_size() + ending_slots - reserved
        return room < b.extend + self._future_tokens(b.req)

    def _schedule(self) -> list[_Item]:
        if self._suspects and not (self._decode_turn and self.running):
            items = self._suspect_alone()
            if items is not None:
                return items
        items: list[_Item] | None = None
        if not (self._decode_turn and self.running):
            items = self._prefill_items()
        self._decode_turn = False
        if items:
            if self.chunked_req is not None or self.interleave_decode:
                self._decode_turn = not self.enable_mixed
            if self.enable_mixed and self.running:
                items += self._decode_items(allow_retract=False)
            return items
        if self.running:
            if self.drafter is not None:
                items = self._verify_items()
                if items is not None:
                    return items
            return self._decode_items(allow_retract=True)
        return []

    # ---- prefill admission ------------------------------------------------------------------
    def _suspect_alone(self) -> list[_Item] | None:
        """A batch of one suspect's next prefill chunk (nothing mixed in), or None when no suspect
        can run now."""
        if self.chunked_req is not None:
            if self.chunked_req.rid not in self._suspects:
                return None
            suspect = None
        else:
            suspect = next((r for r in self.waiting if r.rid in self._suspects), None)
            if suspect is None:
                return None
        others = [r for r in self.waiting if r is not suspect]
        self.waiting = [] if suspect is None else [suspect]
        try:
            items = self._prefill_items()
        finally:
            self.waiting = self.waiting + others
        self._decode_turn = self.chunked_req is not None
        return items or None

    def _future_tokens(self, req: Req) -> int:
        """Tokens to keep free for the rest of this request's life (decaying estimate)."""
        left = min(req.sampling_params.max_new_tokens - len(req.output_ids), CLIP_MAX_NEW_TOKENS)
        return math.ceil(max(left, 0) * self.new_token_ratio)

    def _prefill_items(self) -> list[_Item]:
        self._admission_block = None
        items: list[_Item] = []
        token_budget = self.max_prefill_tokens
        chunk_budget = self.chunk_size if self.chunk_size is not None else math.inf
        if self.enable_mixed and self.running and self.chunk_size is not None:
            # the running requests' decode rows ride in this batch: they count against the chunk, so a
            # mixed step stays at chunked_prefill_size tokens (its cost, and an extend graph's size);
            # at least a quarter of the chunk stays for prompts, so they never starve behind decodes
            chunk_budget = max(self.chunk_size - len(self.running), max(1, self.chunk_size // 4))
        reserved = sum(self._future_tokens(r) for r in self.running)

        whole_only = False  # newcomers must fit this step whole: a prompt is being chunked (one at a time)
        if self.chunked_req is not None:
            req = self.chunked_req
            total = len(req.origin_input_ids) + len(req.output_ids)
            n = int(min(total - req.kv_len, chunk_budget))
            share = int(chunk_budget) // 2
            if (req.kv_len + n < total and share > 0 and self._share_refused_at != self._arrivals
                    and len(self.running) + 1 < self.max_running and self._short_prompt_waiting(share)):
                # a short prompt arrived during this long prefill: it gets up to half the chunk now, so its
                # first token does not wait for the whole long prompt (the long one loses at most half a step)
                n, whole_only = int(chunk_budget) - share, True
            slots = self._alloc_slots(n)
            if slots is None:
                if not self.running:  # nothing else will free memory: start this request over later
                    self.chunked_req = None
                    self._retract(req)
                return []
            self.req_to_token_pool.write(req.req_pool_idx, req.kv_len, slots)
            items.append(_Item(req, req.kv_len, n, False, slots))
            self.metrics.prefill_tokens_computed += n
            if req.kv_len + n < total and not whole_only:
                return items
            chunk_budget -= n
            token_budget -= n
            if not whole_only:
                reserved += self._future_tokens(req)

        # requests still waiting for their grammar are not admissible yet
        candidates = [r for r in self.waiting if r.rid not in self._grammar_pending]
        if not candidates or chunk_budget <= 0 or token_budget <= 0:
            return items
        for req in candidates:
            # fill_ids is always a prefix of all_ids: rebuild it only when short (a long queue waits
            # for memory on every step, and copying each prompt each time was the biggest host cost)
            if len(req.fill_ids) != len(req.origin_input_ids) + len(req.output_ids):
                req.fill_ids = req.all_ids()
            req.prefix_indices, req.last_node = None, None
        resident = len(self.running) + len(items)
        if resident >= self.max_running or self.req_to_token_pool.available_size() == 0:
            # no request can be admitted this step (the loop below would stop before the first): the policy's
            # order is not needed, and a slow order() must not slow every decode step of a full batch
            if whole_only:
                self._share_refused_at = self._arrivals
            return items
        ordered = self._policy_order(candidates)
        if whole_only:  # only prompts that fit the share whole (cache hits aside): no prefix match for the rest
            ordered = [r for r in ordered if len(r.fill_ids) <= chunk_budget]
        self._evicted = False
        admitted: list[Req] = []
        for req in ordered:
            if resident + len(admitted) >= self.max_running or self.req_to_token_pool.available_size() == 0:
                break
            # a policy's match is stale once admission evicted (its nodes were unlocked): match again
            if req.prefix_indices is None or self._evicted:
                m = self._match_for_admission(req)
                if m is None:  # the cache failed on this request: a 500 for it, admission goes on
                    self._fail_admission(req)
                    continue
                req.prefix_indices, req.last_node = m.kv_indices, m.last_node
            if req.prefix_indices.numel() >= len(req.fill_ids):  # keep one token to compute logits from
                req.prefix_indices = req.prefix_indices[: len(req.fill_ids) - 1]
            if req.sampling_params.prompt_logprobs is not None:  # the positions still to score are computed
                req.prefix_indices = req.prefix_indices[: len(req.prompt_token_logprobs)]
            prefix_len = int(req.prefix_indices.numel())
            extend = len(req.fill_ids) - prefix_len
            if whole_only and extend > min(chunk_budget, token_budget):
                continue  # waits for the chunked prompt to finish; a shorter one behind it may fit
            if admitted and self._shares_uncached_prefix(req, prefix_len, admitted):
                continue  # stays waiting: next step the cache holds the shared part
            if extend > token_budget and (items or admitted) and self.chunk_size is None:
                break
            if not self._admission_lock_call(True, req):
                self._fail_admission(req)
                continue
            rem = self.allocator.available_size() + self.cache.evictable_size() - reserved
            if extend + self._future_tokens(req) > rem and (items or admitted or self.running):
                if not self._admission_lock_call(False, req):
                    self._fail_admission(req)
                    break
                self._admission_block = _AdmissionBlock(req, extend, self._arrivals, self.metrics.retractions,
                                                        len(self._grammar_pending))
                break
            take = extend if self.chunk_size is None else int(min(extend, chunk_budget, token_budget))
            self._evict_failed = False
            slots = self._alloc_slots(take)
            row = self.req_to_token_pool.alloc() if slots is not None else None
            if row is None:
                if slots is not None:
                    self.allocator.free(slots)
                if not self._admission_lock_call(False, req):
                    self._fail_admission(req)
                    break
                if slots is None and self._evict_failed:  # the cache cannot make its room: a 500, not a wait forever
                    self.waiting.remove(req)
                    self._end_failed(req, CACHE_FAILED)
                elif slots is None and not (items or admitted or self.running or self.chunked_req is not None
                                            or self._in_flight is not None):
                    # nothing runs, the cache evicted what it could, and the room is still short: the rest is
                    # locked or leaked by the cache and nothing will ever free it (audit 37c: such requests waited
                    # forever while /health said 200)
                    self.waiting.remove(req)
                    req.prefix_indices, req.last_node = None, None
                    self._end_failed(req, self._no_room_message(take))
                break
            req.req_pool_idx = row
            if prefix_len:
                self.req_to_token_pool.write(row, 0, req.prefix_indices)
            req.kv_len = prefix_len
            self.req_to_token_pool.write(row, prefix_len, slots)
            if req.retracted_count == 0:
                req.cached_tokens = prefix_len
            logger.debug("request %s admitted: %d of %d prompt tokens from the prefix cache, %d computed now%s",
                         req.rid, prefix_len, len(req.fill_ids), take, " (retracted before)" if req.retracted_count else "")
            self.metrics.prefill_tokens_cached += prefix_len
            self.metrics.prefill_tokens_computed += take
            items.append(_Item(req, prefix_len, take, False, slots))
            admitted.append(req)
            reserved += self._future_tokens(req) + (extend - take)
            chunk_budget -= take
            token_budget -= take
            if take < extend:
                self.chunked_req = req
                break
            if chunk_budget <= 0 or token_budget <= 0:
                break
        if whole_only and not admitted:  # no room for it after all (memory): no share again until a new arrival
            self._share_refused_at = self._arrivals
        if admitted:
            gone = set(map(id, admitted))
            self.waiting = [r for r in self.waiting if id(r) not in gone]
        return items

    def _short_prompt_waiting(self, limit: int) -> bool:
        """Whether an admissible waiting request's whole prompt (cache hits not counted) is at most `limit`
        tokens."""
        return any(len(r.origin_input_ids) + len(r.output_ids) <= limit
                   for r in self.waiting if r.rid not in self._grammar_pending)

    def _shares_uncached_prefix(self, req: Req, cached: int, admitted: list[Req]) -> bool:
        """Whether an admitted request has the same first `cached + in_batch_prefix` tokens."""
        k = self.in_batch_prefix
        end = cached + k
        if k == 0 or len(req.fill_ids) <= end:
            return False
        window = req.fill_ids[cached:end]
        return any(
            len(other.fill_ids) > end and other.fill_ids[cached:end] == window and other.fill_ids[:cached] == req.fill_ids[:cached]
            for other in admitted
        )

    def _no_room_message(self, need: int) -> str:
        """Why a request that needs `need` KV slots can never be admitted with nothing running."""
        size, free = self.allocator.size, self.allocator.available_size()
        evictable, protected = self.cache.evictable_size(), self.cache.protected_size()
        leaked = max(size - free - evictable - protected, 0)
        return (f"the KV pool can never make room for this request: {need} slots needed, {free} free of {size} with "
                f"no request running; {self.cache_label} holds {protected} locked slots and {leaked} are owned by "
                "nobody (see the log's slot audit): restart the server to recover them")

    def _checked_match(self, key: list[int]) -> Any:
        """`cache.match_prefix(key)`, a TypeError in the conformance kit's words when it is not a MatchResult of at
        most one int64 CPU slot per key token (a plugin's wrong answer must not reach the row writes)."""
        m = self.cache.match_prefix(key)
        problem = match_result_problem(m, len(key))
        if problem is not None:
            raise TypeError(problem)
        return m

    def _match_for_admission(self, req: Req) -> Any:
        """`cache.match_prefix(req.fill_ids[:-1])`, checked as the conformance kit checks it; None when it
        raised or returned anything but a MatchResult of at most one int64 CPU slot per key token
        (counted in plugin_failures, logged once naming the cache: the caller fails the request)."""
        try:
            return self._checked_match(req.fill_ids[:-1])
        except Exception:
            self._failures.exception(f"{self.cache_label}: match_prefix failed; the request being admitted ends "
                                     "with an internal error (500)")
            logger.debug("%s: match_prefix failed for request %s", self.cache_label, req.rid)
            return None

    def _admission_lock_call(self, lock: bool, req: Req) -> bool:
        """`cache.inc_lock_ref(req.last_node)` (`lock`) or `dec_lock_ref` at admission (no row or slot taken
        yet); False when it raised (counted, logged once naming the cache: the caller fails the request)."""
        call = "inc_lock_ref" if lock else "dec_lock_ref"
        try:
            if lock:
                self.cache.inc_lock_ref(req.last_node)
            else:
                self.cache.dec_lock_ref(req.last_node)
            return True
        except Exception:
            self._failures.exception(f"{self.cache_label}: {call} failed at admission; the request ends with an "
                                     "internal error (500)")
            logger.debug("%s: %s failed for request %s", self.cache_label, call, req.rid)
            return False

    def _fail_admission(self, req: Req) -> None:
        """End a waiting request that holds no row or KV slot because a cache call for it failed."""
        self.waiting.remove(req)
        req.prefix_indices, req.last_node = None, None
        self._end_failed(req, CACHE_FAILED)

    def _alloc_slots(self, n: int) -> torch.Tensor | None:
        """n free KV slots, evicting from the prefix cache when needed; None if they do not exist."""
        short = n - self.allocator.available_size()
        if short > 0:
            self._evict(short)
            self._evicted = True
        return self.allocator.alloc(n)

    def _policy_order(self, candidates: list[Req]) -> list[Req]:
        """`policy.order(candidates, cache)`; where it raises or returns anything but the candidates
        themselves, each once, this step admits in arrival order instead (logged, naming the policy):
        a policy's bug must not end the runtime or lose a request."""
        try:
            out = self.policy.order(candidates, self.cache)
            if type(out) is not list:  # the conformance kit's words (check_schedule_policy); a tuple is taken
                if isinstance(out, str | bytes | dict) or not isinstance(out, Iterable):
                    raise TypeError(f"order() returned {type(out).__name__}, not a list (contract section 4)")
                out = list(out)
            ordered = out
            if ordered and not isinstance(ordered[0], Req):  # a sample: the permutation check below sees the rest
                raise TypeError(f"order() returned a list of {type(ordered[0]).__name__}, not the waiting requests "
                                "themselves (contract section 4)")
            if len(ordered) == len(candidates) and {id(r) for r in ordered} == {id(r) for r in candidates}:
                return ordered
            raise ValueError(f"order() returned {len(ordered)} requests for {len(candidates)} waiting, not a "
                             "permutation of them (contract section 4)")
        except Exception:
            self._failures.exception(f"{self.policy_label}: order() failed; this step admits in arrival order")
        for req in candidates:  # a match the policy stored before failing is dropped: matched again below
            req.prefix_indices, req.last_node = None, None
        return sorted(candidates, key=lambda r: r.arrival_time)

    def _evict(self, n: int) -> None:
        """`cache.evict(n)`. One that raises (a double free under scheduler.debug_kv_checks: the
        allocator refused the free before changing anything) is logged naming the cache and frees
        nothing more: the allocation that needed the room fails as on a full pool."""
        try:
            self.cache.evict(n)
        except Exception:
            self._evict_failed = True
            self._failures.exception(f"{self.cache_label}: evict failed; the slots it was to free stay unavailable")

    # ---- decode -----------------------------------------------------------------------------
    def _decode_items(self, allow_retract: bool) -> list[_Item]:
        need = len(self.running)
        if self.allocator.available_size() < need:
            self._evict(need - self.allocator.available_size())
        if self.allocator.available_size() < need:
            if not allow_retract:
                return []
            self._retract_for_decode()
        slots = self._decode_slots(self.running)
        if slots is None:
            return []
        self._write_rows(self.running, slots)
        items = [_Item(req, req.kv_len, 1, True, slots[i : i + 1]) for i, req in enumerate(self.running)]
        self.new_token_ratio = max(self.min_ratio, self.new_token_ratio - self.ratio_decay)
        return items

    def _decode_slots(self, reqs: list[Req]) -> torch.Tensor | None:
        """One slot per request for its next token, from its `decode_reserve`. Requests without
        one get a run of DECODE_RUN slots when that many are free for each of them (never evicting
        for it), else a single slot (evicting if needed); None if even that is not possible."""
        empty = [r for r in reqs if not r.decode_reserve]
        if empty:
            if self.allocator.available_size() >= len(empty) * DECODE_RUN:
                runs = self.allocator.alloc(len(empty) * DECODE_RUN).view(len(empty), DECODE_RUN).tolist()
            else:
                single = self._alloc_slots(len(empty))
                if single is None:
                    return None
                runs = [[s] for s in single.tolist()]
            for req, run in zip(empty, runs, strict=True):
                req.decode_reserve = run
        return torch.tensor([r.decode_reserve.pop(0) for r in reqs], dtype=torch.int64)

    # ---- speculative verify -----------------------------------------------------------------
    def _verify_items(self) -> list[_Item] | None:
        """The running requests as a verify batch (each its last token plus its drafts), or None
        when this step decodes plainly: the safeguard turned drafts off, no request got a draft,
        the drafter failed, or the drafts' KV slots are not free (plain decode may then retract)."""
        reqs = self.running
        k = self.draft_control.tokens_for(len(reqs))
        if k == 0:
            return None
        if any(r.grammar is not None or r.grammar_start is not None for r in reqs):
            # the grammar bitmask holds one row per request, a verify scores several tokens per
            # request: while a constrained request runs, the batch decodes plainly
            return None
        limits = [self._draft_limit(r, k) for r in reqs]
        asking = [i for i, lim in enumerate(limits) if lim > 0]
        if not asking:
            return None
        try:
            proposal = self.drafter.propose([reqs[i] for i in asking], max(limits[i] for i in asking))
            check_proposal(proposal, len(asking))
            drafts = [Draft([], [-1]) for _ in reqs]
            for j, i in enumerate(asking):
                parents = proposal.parents[j] if proposal.parents is not None else None
                try:
                    drafts[i] = d = checked_draft(proposal.tokens[j], parents, limits[i], self.limits.vocab_size,
                                                  self.trees_ok)
                except TypeError as e:  # the kit's words, with the request they are about
                    raise TypeError(f"request {j} ({reqs[i].rid}): {e}") from None
                if d.invalid:
                    self._count_invalid_drafts(d, reqs[i])
        except Exception:
            self._failures.exception(f"{self.drafter_label}: propose failed; steps decode without drafts")
            return None
        if not any(d.tokens for d in drafts):
            return None
        need = [len(d.parents) for d in drafts]
        slots = self._verify_slots(reqs, need)
        if slots is None:
            return None
        rows, cols = [], []  # one write for the whole batch (a device copy each would cost more)
        for req, sl in zip(reqs, slots, strict=True):
            rows += [req.req_pool_idx] * len(sl)
            cols += range(req.kv_len, req.kv_len + len(sl))
        self.req_to_token_pool.write_positions(rows, cols, torch.cat(slots))
        items = [
            _Item(req, req.kv_len, len(sl), True, sl, draft=d) for req, d, sl in zip(reqs, drafts, slots, strict=True)
        ]
        self.new_token_ratio = max(self.min_ratio, self.new_token_ratio - self.ratio_decay)
        return items

    def _count_invalid_drafts(self, draft: Draft, req: Req) -> None:
        """Draft tokens the core dropped for breaking the drafter contract (out of the vocabulary, a tree parent
        that is not an earlier draft): counted in stats `spec_invalid_draft_tokens`, the first logged once, so an
        author sees why such drafts are never accepted (they cost no failure: the rest of the draft is verified)."""
        self.metrics.spec_invalid_draft_tokens += draft.invalid
        if not self._invalid_drafts_logged:
            self._invalid_drafts_logged = True
            logger.warning("%s: %s in the draft for request %s: the core drops it (with the rest of its chain, or its "
                           "subtree) and verifies the rest (docs/contracts.md section 6a); every such draft token is "
                           "counted in /server_info spec_invalid_draft_tokens, and only this first one is logged",
                           self.drafter_label, draft.invalid_why, req.rid)

    def _draft_limit(self, req: Req, k: int) -> int:
        """Drafts worth verifying: a step yields at most drafts + 1 tokens, so never more than
        the request may still produce, nor past the end of its context."""
        left = req.sampling_params.max_new_tokens - len(req.output_ids) - 1
        room = self.context_len - 1 - req.kv_len
        return max(0, min(k, left, room))

    def _verify_slots(self, reqs: list[Req], need: list[int]) -> list[torch.Tensor] | None:
        """`need[i]` KV slots for request i, from its decode reserve first; fresh runs of at least
        DECODE_RUN when that many are free, else exactly what is missing (evicting if needed)."""
        short = [max(0, n - len(r.decode_reserve)) for r, n in zip(reqs, need, strict=True)]
        total = sum(short)
        if total:
            runs = [max(s, DECODE_RUN) if s else 0 for s in short]
            if self.allocator.available_size() < sum(runs):
                runs = short
                if self.allocator.available_size() + self.cache.evictable_size() < total:
                    return None
            fresh = self._alloc_slots(sum(runs))
            if fresh is None:
                return None
            at = 0
            for r, n in zip(reqs, runs, strict=True):
                r.decode_reserve.extend(fresh[at : at + n].tolist())
                at += n
        out = []
        for r, n in zip(reqs, need, strict=True):
            out.append(torch.tensor(r.decode_reserve[:n], dtype=torch.int64))
            del r.decode_reserve[:n]
        return out

    def _apply_verify(self, it: _Item, result: BatchResult, i: int) -> None:
        """Append the tokens a verify step produced (the accepted drafts, then the target's own
        token), stopping where the request finishes; keep the KV of the tokens kept and give the
        other slots back to the request's reserve."""
        req, draft = it.req, it.draft
        target = result.spec_token_ids[i]
        path = accepted_path(draft, target)
        lps = result.spec_logprobs[i] if result.spec_logprobs is not None else None
        tops = result.spec_top_logprobs[i] if result.spec_top_logprobs is not None else None
        appended = 0
        for node in path:
            self._append_token(req, int(target[node]), lps[node] if lps else None, tops[node] if tops else None)
            appended += 1
            if req.finished:
                break
        # node path[m] holds the token at position prefix_len + m; the first `appended` stay
        kept = path[:appended]
        if not draft.is_chain:
            self.req_to_token_pool.write(req.req_pool_idx, it.prefix_len, it.slots[kept])
        unused = sorted(set(range(len(draft.parents))) - set(kept))
        req.kv_len = it.prefix_len + appended
        if unused:
            req.decode_reserve[:0] = it.slots[unused].tolist()
        if draft.tokens:
            accepted = len(path) - 1
            self._step_acceptance.append(accepted)
            self.metrics.spec_verifies += 1
            self.metrics.spec_draft_tokens += len(draft.tokens)
            self.metrics.spec_accepted_tokens += accepted
            meta = self.meta.get(req.rid)
            if meta is not None:
                meta.spec_verify_ct += 1
                meta.spec_accepted_drafts += accepted

    def _notify_drafter(self, req: Req, n_before: int) -> None:
        if self.drafter is None or len(req.output_ids) <= n_before:
            return
        try:
            self.drafter.on_accepted(req, req.output_ids[n_before:])
        except Exception:
            self._failures.exception(f"{self.drafter_label}: on_accepted failed (ignored)")

    def _drafter_forget(self, req: Req) -> None:
        if self.drafter is None:
            return
        try:
            self.drafter.on_finished(req)
        except Exception:
            self._failures.exception(f"{self.drafter_label}: on_finished failed (ignored)")

    def _write_rows(self, reqs: list[Req], slots: torch.Tensor) -> None:
        """Store each request's next-token slot at position kv_len of its row."""
        self.req_to_token_pool.write_positions([r.req_pool_idx for r in reqs], [r.kv_len for r in reqs], slots)

    def _retract_for_decode(self) -> None:
        """Re-queue running requests (fewest outputs, then longest prompt first) until one decode
        step fits; their KV goes to the cache (radix) or back to the allocator (chunk)."""
        order = sorted(self.running, key=lambda r: (len(r.output_ids), -len(r.origin_input_ids)))
        while self.allocator.available_size() + self.cache.evictable_size() < len(self.running):
            if len(self.running) == 1:
                if self.chunked_req is None:
                    break
                req, self.chunked_req = self.chunked_req, None  # it holds the memory the last one needs
            else:
                req = order.pop(0)
                self.running.remove(req)
            self._retract(req)
        self._evict(len(self.running) - self.allocator.available_size())
        # budgets were too optimistic: reserve more for the requests still running
        total_left = sum(r.sampling_params.max_new_tokens - len(r.output_ids) for r in self.running) or 1
        decoded = sum(len(r.output_ids) for r in self.running)
        self.new_token_ratio = min(1.0, max(self.new_token_ratio, (decoded + 20 * len(self.running)) / total_left))

    def _retract(self, req: Req) -> None:
        if not self._release(req):  # the cache failed on it: it ends here instead of waiting to rerun
            self._end_failed(req, CACHE_FAILED)
            return
        req.fill_ids = req.all_ids()
        req.prefix_indices, req.last_node, req.kv_len = None, None, 0
        req.retracted_count += 1
        self.metrics.retractions += 1
        self.waiting.append(req)
        logger.debug("retracted %s after %d output tokens", req.rid, len(req.output_ids))

    def _free_decode_reserve(self, req: Req) -> None:
        """Return the decode slots set aside for the request and not used yet."""
        if req.decode_reserve:
            self.allocator.free(torch.tensor(req.decode_reserve, dtype=torch.int64))
            req.decode_reserve = []

    def _release(self, req: Req) -> bool:
        """Give up the request's KV (the cache keeps what it wants), its unused decode slots and its
        row. False when the cache's cache_finished_req raised (logged; the caller ends the request with a 500)."""
        self._free_decode_reserve(req)
        if req.req_pool_idx is None:
            return True
        own_from = self._own_from(req)
        try:
            self.cache.cache_finished_req(req)
        except Exception:
            self._cache_failed("cache_finished_req", req, own_from)
            return False
        self.req_to_token_pool.free(req.req_pool_idx)
        req.req_pool_idx = None
        req.last_node = None
        return True

    # ---- running a batch --------------------------------------------------------------------
    def _to_scheduled_batch(
        self, items: list[_Item], future: FutureTokens | None = None, prev_step: _PrevStep | None = None
    ) -> ScheduledBatch:
        """`prev_step`: the in-flight step this batch (a decode launched ahead, reading `future`)
        follows, still to be processed."""
        input_ids: list[int] = []
        for it in items:
            r = it.req
            r.kv_len = it.prefix_len + it.extend_len  # the batch owns these slots from now on
            if future is not None:
                continue
            if it.draft is not None:
                input_ids.append(r.output_ids[-1])
                input_ids.extend(it.draft.tokens)
            elif it.decode:
                input_ids.append(r.output_ids[-1])
            else:
                full = r.all_ids()
                input_ids.extend(full[it.prefix_len : it.prefix_len + it.extend_len])
        slots = [it.slots for it in items]
        all_decode = all(it.decode for it in items)
        verify = any(it.draft is not None for it in items)
        if verify:
            self.metrics.spec_verify_batches += 1
        elif any(it.decode for it in items) and not all_decode:
            self.metrics.mixed_batches += 1
        elif all_decode:
            self.metrics.decode_batches += 1
        else:
            self.metrics.prefill_batches += 1
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("batch: %d decode rows, %d prompt tokens of %d requests%s%s; %d running, %d waiting",
                         sum(it.decode for it in items), sum(it.extend_len for it in items if not it.decode),
                         sum(not it.decode for it in items), ", speculative verify" if verify else "",
                         ", launched ahead" if future is not None else "", len(self.running), len(self.waiting))
        sample_mask = [it.completes_prompt for it in items]
        scored = _prompt_logprob_rows(items) if not (verify or all_decode) else None  # only prefill rows score
        if prev_step is None:
            bitmask = self._token_bitmask(items, sample_mask)
        else:
            bitmask = self._bitmask_after(items, prev_step)
        return ScheduledBatch(
            mode=ForwardMode.DECODE if all_decode and not verify else ForwardMode.EXTEND,
            reqs=[it.req for it in items],
            input_ids=input_ids,
            req_pool_indices=[it.req.req_pool_idx for it in items],
            prefix_lens=[it.prefix_len for it in items],
            extend_lens=[it.extend_len for it in items],
            out_cache_loc=torch.cat(slots) if len(slots) > 1 else slots[0],
            sample_mask=sample_mask,
            future_inputs=future,
            spec=SpecVerify([it.draft.parents for it in items]) if verify else None,
            token_bitmask=bitmask[0] if bitmask else None,
            apply_bitmask=self.grammar.ready_backend.apply_bitmask_inplace if bitmask else None,
            token_bitmask_ready=bitmask[1] if bitmask else None,
            prompt_logprob_rows=scored,
        )

    def _token_bitmask(self, items: list[_Item], sample_mask: list[bool]) -> tuple[torch.Tensor, Callable] | None:
        """The allowed next tokens of each constrained row that samples this step, filled in a
        thread while the forward runs (the matchers already accepted every token up to this step),
        with the function that waits for that fill; None when no such row."""
        rows = [i for i, it in enumerate(items) if sample_mask[i] and it.req.grammar is not None]
        if not rows:
            return None
        bitmask = self._new_bitmask(len(items))
        _allow_all(bitmask, set(range(len(items))) - set(rows))
        matchers = [(i, items[i].req.grammar) for i in rows]
        pool, fill = self._mask_pool_executor(), self.grammar.ready_backend.fill_bitmasks
        # on CUDA the launch that follows is Python holding the GIL: hand it over first (_started);
        # a CPU forward's torch calls release it, and the hand-off would only add a wake-up per step
        fut = _started(pool, fill, bitmask, matchers) if self._pin_bitmasks else pool.submit(fill, bitmask, matchers)
        return bitmask, fut.result

    def _bitmask_after(self, items: list[_Item], prev_step: _PrevStep) -> tuple[torch.Tensor, Callable] | None:
        """The bitmask of a decode launched ahead of the in-flight step `prev_step`, whose tokens
        the matchers have not accepted yet; None when no row is (or may become, DeferredGrammar)
        constrained. The runner calls the returned function on the scheduler's thread once the
        forward is queued and before sampling: it processes `prev_step` (the matchers accept its
        tokens, requests finish) while the device computes, then fills the rows still constrained.
        Rows whose request finished in `prev_step` keep every token allowed (their token is dropped)."""
        if not any(it.req.grammar is not None or it.req.grammar_start is not None for it in items):
            return None
        bitmask = self._new_bitmask(len(items))
        launching = threading.get_ident()
        if self.fill_beside_processing and self.fill_before_launch and prev_step.tokens_on_host():
            prev_step.early = self._accept_and_fill_early(items, prev_step, bitmask)

        def ready() -> None:
            if threading.get_ident() != launching:  # it processes prev: the scheduler's state, one thread
                raise RuntimeError("token_bitmask_ready() of a batch launched ahead must be called on the thread "
                                   "that called launch_batch, before launch_batch returns")
            backend = self.grammar.ready_backend
            if prev_step.early is not None:  # prev's tokens accepted and the rows filled meanwhile
                accepted, filled, error = prev_step.early.result()
                prev_step.process(accepted=accepted)
                if error is not None:
                    raise error
                self._finish_bitmask(items, bitmask, filled)
                return
            filling: list = []  # (rows, future) of the fill started once prev's tokens are accepted

            def start_fill(ended: set[int]) -> None:
                # requests whose matcher refused or ended with prev's token are left out; rows of
                # requests that end otherwise in prev (a stop string, EOS) are filled and reset below
                rows = [(i, it.req.grammar) for i, it in enumerate(items)
                        if it.req.grammar is not None and not it.req.finished and id(it.req) not in ended]
                if rows:  # xgrammar releases the GIL: the rest of prev's processing runs meanwhile
                    filling.append((rows, _started(self._mask_pool_executor(), backend.fill_bitmasks, bitmask, rows)))

            try:
                prev_step.process(start_fill if self.fill_beside_processing else None)
            finally:  # never leave a fill running on matchers the scheduler goes on using
                for _, fut in filling:
                    wait_futures([fut])
            filled = {i for rows, fut in filling for i, _ in rows}
            for _, fut in filling:
                fut.result()  # re-raises a fill error (the batch then fails like a failed forward)
            self._finish_bitmask(items, bitmask, filled)

        return bitmask, ready

    def _accept_and_fill_early(self, items: list[_Item], prev_step: _PrevStep, bitmask: torch.Tensor) -> Future:
        """In the mask thread, now (before the launch of `items`, whose forward does not read the
        matchers): prev's tokens into the matchers, then the rows of `items` still constrained
        filled. The future gives (the accept's result, filled rows, a fill error or None)."""
        prev_items, result = prev_step.items, prev_step.result()
        backend = self.grammar.ready_backend

        def accept_and_fill() -> tuple[dict[int, tuple[bool, bool]], set[int], Exception | None]:
            accepted = self._accept_grammar_tokens(prev_items, result)
            ended = {id(prev_items[i].req) for i, (ok, term) in accepted.items() if term or not ok}
            rows = [(i, it.req.grammar) for i, it in enumerate(items)
                    if it.req.grammar is not None and not it.req.finished and id(it.req) not in ended]
            try:
                if rows:
                    backend.fill_bitmasks(bitmask, rows)
            except Exception as e:  # prev's tokens were accepted: ready() still processes them
                return accepted, set(), e
            return accepted, {i for i, _ in rows}, None

        return _started(self._mask_pool_executor(), accept_and_fill)

    def _finish_bitmask(self, items: list[_Item], bitmask: torch.Tensor, filled: set[int]) -> None:
        """After prev's processing: fill the rows whose grammar started in prev (every constrained
        row when none was filled beside), then allow every token in the rows not filled and in
        rows whose request finished in prev (its token is dropped)."""
        late = [(i, it.req.grammar) for i, it in enumerate(items)
                if it.req.grammar is not None and not it.req.finished and i not in filled]
        if late:
            self.grammar.ready_backend.fill_bitmasks(bitmask, late)
        filled = filled | {i for i, _ in late}
        _allow_all(bitmask, {i for i in range(len(items)) if i not in filled or items[i].req.finished})

    def _mask_pool_executor(self) -> ThreadPoolExecutor:
        if self._mask_pool is None:  # one thread: a matcher is only ever used by one thread at a time
            self._mask_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-mask")
        return self._mask_pool

    def _new_bitmask(self, batch_size: int) -> torch.Tensor:
        """The step's bitmask, rows not written yet: the first rows of one of two buffers used in
        turn (pinned on CUDA: the runner's copy to the device does not block the host). Every row
        must then be filled (a backend writes every word of a row it fills) or set by `_allow_all`;
        not clearing the whole buffer saves a 1 MB memset per step at 64 rows. Reuse is safe: at
        most one batch is in flight, so the buffer's previous batch (two masked batches ago) has
        had its tokens read, which comes after its mask was copied to the device."""
        self._bitmask_turn ^= 1
        buf = self._bitmask_bufs[self._bitmask_turn]
        if buf is None or buf.shape[0] < batch_size:
            fresh = self.grammar.ready_backend.allocate_bitmask(max(batch_size, 2 * (0 if buf is None else buf.shape[0])))
            buf = fresh.pin_memory() if self._pin_bitmasks else fresh
            self._bitmask_bufs[self._bitmask_turn] = buf
        return buf[:batch_size]

    def _accept_grammar_tokens(self, items: list[_Item], result: BatchResult) -> dict[int, tuple[bool, bool]]:
        """The step's tokens into their matchers, every constrained row in one backend call:
        {row: (accepted, terminated)} for the rows `_append_token` would advance a matcher for."""
        rows = [i for i, it in enumerate(items)
                if it.req.grammar is not None and it.req.grammar_start is None and _appends_sampled_token(it)]
        if not rows:
            return {}
        matchers = [items[i].req.grammar for i in rows]
        ok = self.grammar.ready_backend.accept_tokens(matchers, [int(result.next_token_ids[i]) for i in rows])
        return {i: (bool(a), bool(a) and m.is_terminated()) for i, m, a in zip(rows, matchers, ok, strict=True)}

    def _process(self, items: list[_Item], result: BatchResult,
                 on_accepted: Callable[[set[int]], None] | None = None,
                 accepted: dict[int, tuple[bool, bool]] | None = None) -> None:
        """`on_accepted(ended)`, if given, is called once the constrained rows' matchers accepted
        their tokens, before the per-request work; `ended`: id() of the requests whose matcher
        refused its token or terminated (they end in this step). `accepted`: what
        `_accept_grammar_tokens` returned when it already ran for this step (the early accept)."""
        now_running: list[Req] = []
        self._step_acceptance = []
        if accepted is None:
            accepted = self._accept_grammar_tokens(items, result) if self.grammar is not None else {}
        if on_accepted is not None:
            on_accepted({id(items[i].req) for i, (ok, term) in accepted.items() if term or not ok})
        if result.prompt_token_logprobs is not None:
            _store_prompt_logprobs(items, result)
        for i, it in enumerate(items):
            req = it.req
            if req.finished:  # overlap: aborted, or stopped a step earlier, while this batch ran
                continue
            if not it.decode:
                req.fill_ids = req.all_ids()[: req.kv_len]
                # share the prompt with later requests now, not only when this one finishes
                own_from = self._own_from(req)
                try:
                    self.cache.cache_unfinished_req(req)
                except Exception:
                    self._cache_failed("cache_unfinished_req", req, own_from)
                    if req is self.chunked_req:
                        self.chunked_req = None
                    self._end_failed(req, CACHE_FAILED)
                    continue
                if not it.completes_prompt:
                    continue
                if req is self.chunked_req:
                    self.chunked_req = None
            n_before = len(req.output_ids)
            if _appends_sampled_token(it):
                lp = result.token_logprobs[i] if result.token_logprobs is not None else None
                top = result.top_logprobs[i] if result.top_logprobs is not None else None
                self._append_token(req, int(result.next_token_ids[i]), lp, top, accepted.get(i))
            elif it.draft is not None:
                self._apply_verify(it, result, i)
            else:  # max_new_tokens 0: the request ends without a token
                req.finished_reason = {"type": "length"}
            self._notify_drafter(req, n_before)
            if req.finished:
                released = self._release(req)
                if it.decode:
                    self.running.remove(req)
                if not released:  # the cache failed on it: a 500 instead of its output
                    self._end_failed(req, CACHE_FAILED)
                    continue
                self._drafter_forget(req)
                self.metrics.finished_requests += 1
            elif not it.decode:
                now_running.append(req)
            self._emit(req)
        self.running.extend(now_running)
        if self._step_acceptance:  # the safeguard's average moves once per verify step
            self.draft_control.record(self._step_acceptance)

    def _append_token(self, req: Req, token: int, lp: float | None, top: list | None,
                      accepted: tuple[bool, bool] | None = None) -> None:
        """`accepted`: (accepted, terminated) when the request's matcher already took `token`."""
        req.output_ids.append(token)
        self.metrics.generated_tokens += 1
        if req.sampling_params.logprobs:
            req.output_token_logprobs.append(float("nan") if lp is None else float(lp))
            req.output_top_logprobs.append(list(top or []))
        if req.grammar_start is not None:
            if req.grammar_start.reached(token):  # the constraint applies from the next token on
                req.grammar = self.grammar.ready_backend.new_matcher(req.grammar_start.compiled)
                req.grammar_start = None
        elif req.grammar is not None and not self._grammar_accepts(req, token, accepted):
            return
        sp = req.sampling_params
        n = len(req.output_ids)
        meta = self.meta.get(req.rid)
        if meta is not None and meta.stop_matcher is not None:
            # like EOS, a stop string cannot end the first min_new_tokens (unless a grammar decides the end)
            hold = n <= sp.min_new_tokens and req.grammar is None
            matched = meta.stop_matcher.push(token, search=not hold)
            if matched is not None:
                req.finished_reason = {"type": "stop", "matched": matched}
                return
        if n >= sp.min_new_tokens and (token in req.eos_token_ids or token in sp.stop_token_ids):
            req.finished_reason = {"type": "stop", "matched": token}
        elif n >= sp.max_new_tokens or len(req.origin_input_ids) + n >= self.context_len:
            req.finished_reason = {"type": "length"}

    def _grammar_accepts(self, req: Req, token: int, accepted: tuple[bool, bool] | None = None) -> bool:
        """Advance the request's matcher (unless `accepted` says it already took the token); False
        when that ended the request (its grammar is complete, or it refused a token its own mask allowed)."""
        if accepted is None:
            ok = req.grammar.accept_token(token)
            accepted = (ok, ok and req.grammar.is_terminated())
        if not accepted[0]:
            logger.error("request %s: the grammar refused token %d that its mask allowed", req.rid, token)
            # the token is not the constraint's: it leaves the output (grammar audit 34: it stayed in the text)
            req.output_ids.pop()
            if req.sampling_params.logprobs:
                req.output_token_logprobs.pop()
                req.output_top_logprobs.pop()
            req.finished_reason = {"type": "abort", "message": "the grammar backend refused a token it allowed"}
            return False
        if accepted[1]:
            req.finished_reason = {"type": "stop", "matched": token}
            return False
        return True

    # ---- results out ------------------------------------------------------------------------
    def _emit(self, req: Req, force: bool = False) -> None:
        meta = self.meta.get(req.rid)
        if meta is None:
            return
        fin = req.finished
        matcher = meta.stop_matcher
        # tokens that may still turn out to be part of a stop string wait (streaming)
        end = len(req.output_ids) if fin or force or matcher is None else matcher.safe
        if not (fin or force):
            pending = end - meta.sent
            if not meta.stream or pending <= 0:
                return
            if meta.first_sent and pending < self.stream_interval:
                return
        returned = end  # the tokens of a matched stop string are decoded (for the text cut), not returned
        if matcher is not None and matcher.matched is not None and not req.sampling_params.no_stop_trim:
            returned = max(matcher.keep, meta.sent)
        out = ReqTokenOut(
            rid=req.rid,
            new_ids=req.output_ids[meta.sent : end],
            finished_reason=req.finished_reason,
            num_stop_tokens=end - returned,
            completion_tokens=len(req.output_ids),
            cached_tokens=req.cached_tokens,
            skip_special_tokens=req.sampling_params.skip_special_tokens,
            stop=meta.stop,
            no_stop_trim=req.sampling_params.no_stop_trim,
            stop_hold=0 if matcher is None else matcher.held,
            stream=meta.stream,
            prompt_tail=None if meta.first_sent else req.origin_input_ids[-PROMPT_TAIL:],
            spec_verify_ct=meta.spec_verify_ct,
            spec_accepted_drafts=meta.spec_accepted_drafts,
        )
        if req.sampling_params.logprobs:
            out.token_logprobs = req.output_token_logprobs[meta.sent : returned]
            out.top_logprobs = [list(map(tuple, alts)) for alts in req.output_top_logprobs[meta.sent : returned]]
        if not meta.first_sent and req.sampling_params.prompt_logprobs is not None:
            out.prompt_token_logprobs = list(req.prompt_token_logprobs)
            out.prompt_token_ranks = list(req.prompt_token_ranks)
            if req.sampling_params.prompt_logprobs:
                out.prompt_top_logprobs = [list(map(tuple, alts)) for alts in req.prompt_top_logprobs]
        meta.sent = end
        meta.first_sent = True
        self._outbox.append(out)
        if fin:
            del self.meta[req.rid]
            logger.debug("request %s finished (%s): %d output tokens, %d prompt tokens from the cache", req.rid,
                         req.finished_reason.get("type") if isinstance(req.finished_reason, dict) else req.finished_reason,
                         len(req.output_ids), req.cached_tokens)

    # ---- introspection ----------------------------------------------------------------------
    def _resident(self) -> set[Req]:
        """Requests holding KV: running, being chunked, or admitted by a batch still in flight."""
        out = set(self.running)
        if self.chunked_req is not None:
            out.add(self.chunked_req)
        if self._in_flight is not None:
            out.update(it.req for it in self._in_flight[0] if not it.req.finished)
        return out

    def _allocator_retries(self) -> int:
        retries = getattr(self.runner, "allocator_retries", None)  # runners other than ModelRunner: none
        return retries() if callable(retries) else 0

    def stats(self) -> dict[str, Any]:
        size = self.allocator.size
        free = self.allocator.available_size()
        evictable = self.cache.evictable_size()
        m = self.metrics
        return {
            "running": len(self._resident()),
            "waiting": len(self.waiting),
            "max_total_tokens": size,
            "free_tokens": free,
            "cached_tokens": evictable + self.cache.protected_size(),
            "token_usage": (size - free - evictable) / size,
            "cache_hit_rate": m.cache_hit_rate(),
            "prefill_tokens_computed": m.prefill_tokens_computed,
            "prefill_tokens_cached": m.prefill_tokens_cached,
            "generated_tokens": m.generated_tokens,
            "throughput": m.throughput(),
            "finished_requests": m.finished_requests,
            "aborted_requests": m.aborted_requests,
            "failed_requests": m.failed_requests,
            "rejected_requests": m.rejected_requests,
            "retractions": m.retractions,
            "prefill_batches": m.prefill_batches,
            "decode_batches": m.decode_batches,
            "mixed_batches": m.mixed_batches,
            "overlapped_batches": m.overlapped_batches,
            "steps": m.steps,
            "step_seconds": m.step_seconds,
            "forward_seconds": m.forward_seconds,
            # why a CUDA run slows down between identical schedules (memory too tight for activations)
            "cuda_alloc_retries": self._allocator_retries(),
            "new_token_ratio": self.new_token_ratio,
            "speculative": self.drafter is not None,
            "spec_verify_batches": m.spec_verify_batches,
            "spec_verifies": m.spec_verifies,
            "spec_draft_tokens": m.spec_draft_tokens,
            "spec_accepted_tokens": m.spec_accepted_tokens,
            "spec_invalid_draft_tokens": m.spec_invalid_draft_tokens,
            "spec_accept_length": m.spec_accept_length(),
            "spec_mean_accepted_drafts": self.draft_control.mean_accepted if self.drafter is not None else 0.0,
            "plugin_failures": self._failures.total,
            **self._cache_stats(),
            "time": time.time(),
        }

    def _cache_stats(self) -> dict[str, int | float]:
        """The prefix cache's own counters (PrefixCache.stats) as prefix_cache_<name>: numbers only,
        and a cache whose stats() fails costs only its counters."""
        try:
            own = self.cache.stats()
        except Exception:
            self._failures.exception("the prefix cache's stats() failed (its counters are left out)")
            return {}
        return {f"prefix_cache_{k}": v for k, v in (own or {}).items()
                if isinstance(k, str) and isinstance(v, int | float) and not isinstance(v, bool)}


def grammar_service(config: Config, runner: Any, registry: Any, tokenizer: Any = None) -> GrammarService | None:
    """The GrammarService of `stack.grammar` (None: no grammar backend in the stack). The backend
    is built in the service's pool on the first constrained request, with the model's tokenizer."""
    from radixserve.plugins.stack import resolve_grammar

    spec = resolve_grammar(config, registry, str(getattr(runner, "device", "cpu")))
    if spec is None:
        return None

    def make_backend():
        # the tokenizer first: its load imports transformers under load_tokenizer's lock, before the
        # backend's own import (which may import transformers too) runs beside the scheduler's thread
        tok = tokenizer if tokenizer is not None else runner.tokenizer
        if tok is None:
            raise RuntimeError("the model has no tokenizer")
        cls = registry.load("grammar", spec.name)
        return cls(tok, int(runner.vocab_size), sorted(getattr(runner, "eos_token_ids", ()) or ()))

    key = tokenizer_fingerprint(str(getattr(runner, "model_path", "")), config.model.tokenizer)
    sg = config.stack
    return GrammarService(spec.name, make_backend, key, sg.grammar_compile_threads, sg.grammar_cache_size)
