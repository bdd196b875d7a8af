"""Handlers of /v1/chat/completions, /v1/completions and the native /generate.

Each handler validates through `radixserve.validation` (token ids against the vocabulary,
sampling fields, the context budget; 400s name the API's field), turns the request into
one `GenerateInput` per choice (n choices x prompts), runs them through a `Fanout`, and shapes the
result as OpenAI JSON or SSE. A client that goes away (streaming or not) aborts its generations.
Every finished request logs one INFO line (id, tokens, latency) and updates the metrics."""

from __future__ import annotations

import codecs
import dataclasses
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from radixserve.server import protocol as p
from radixserve.server import protocol_tools as pt
from radixserve.server.chat_output import ChoiceOutput
from radixserve.server.chat_plan import ChatPlan, plan_chat
from radixserve.server.constraint_errors import response_format_refusal
from radixserve.server.errors import APIError, error_body, model_not_found, refused
from radixserve.server.generation import ClientGone, Fanout, Job, until_disconnect
from radixserve.server.metrics import ServerMetrics
from radixserve.server.parser_selection import OutputParsers
from radixserve.server.runtime_api import GenerateInput, RequestError
from radixserve.serving_tokenizer import off_the_loop
from radixserve.state import SamplingParams, copy_seed, sample_copy
from radixserve.validation import (
    MAX_N,
    NATIVE,
    FieldNames,
    InvalidRequest,
    check_copy_seeds,
    check_same_n,
    check_sampling,
    check_token_ids,
    max_new_tokens_for,
    sampling_from_dict,
)

logger = logging.getLogger("radixserve.server")

# the OpenAI routes' names of the checked fields (errors name what the client sent)
_OPENAI_NAMES = (("min_new_tokens", "min_tokens"),)
OPENAI_FIELDS = FieldNames(prompt="prompt", max_new_tokens="max_tokens", renamed=_OPENAI_NAMES)
CHAT_FIELDS = FieldNames(prompt="messages", max_new_tokens="max_tokens", renamed=_OPENAI_NAMES)
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
_LOGPROB_FLOOR = -9999.0  # JSON has no -inf; impossible tokens are reported at this floor


def sse(data: str) -> str:
    return f"data: {data}\n\n"


def choice_rid(base: str, total: int, index: int) -> str:
    """The rid of generation `index` of `total` run under the rid `base`: `base` itself when alone."""
    return base if total == 1 else f"{base}-{index}"


def _native_names(k: int | None) -> FieldNames:
    """/generate's field names for sampling_params entry `k` of a per-prompt list (None: one object for all)."""
    where = "sampling_params" if k is None else f"sampling_params[{k}]"
    return dataclasses.replace(NATIVE, max_new_tokens=f"{where}.max_new_tokens", sampling=f"{where}.")


def _most(*counts: int | None) -> int | None:
    """The largest of the alternatives counts asked for (None where none was)."""
    asked = [c for c in counts if c is not None]
    return max(asked) if asked else None


def _finite(x: float | None) -> float:
    if x is None or math.isnan(x):
        return _LOGPROB_FLOOR
    return max(float(x), _LOGPROB_FLOOR)


def _finish(meta: dict) -> tuple[str | None, int | str | None]:
    """OpenAI finish_reason and the matched stop string / token id."""
    fr = meta.get("finish_reason")
    if not fr:
        return None, None
    kind = fr.get("type")
    return ("stop" if kind == "stop" else "length" if kind == "length" else str(kind)), fr.get("matched")


@dataclass
class ChoiceState:
    """What has been streamed for one choice so far."""

    text_len: int = 0
    logprobs_sent: int = 0
    started: bool = False
    finished: bool = False
    last: dict = field(default_factory=dict)


@dataclass
class _Tally:
    """Usage of one response: prompt tokens count once per prompt, not per choice."""

    prompt: dict[int, int] = field(default_factory=dict)  # prompt index -> tokens
    cached: dict[int, int] = field(default_factory=dict)
    completion: int = 0

    def add(self, prompt_index: int, meta: dict) -> None:
        self.prompt[prompt_index] = int(meta.get("prompt_tokens", 0))
        # once per prompt too, and the fewest of its choices: with n > 1 the siblings hit the prefix
        # that choice 0 has just computed, which is no cache hit for the request (a cold prompt is 0)
        cached = int(meta.get("cached_tokens", 0))
        self.cached[prompt_index] = min(self.cached.get(prompt_index, cached), cached)
        self.completion += int(meta.get("completion_tokens", 0))

    def usage(self) -> p.UsageInfo:
        prompt = sum(self.prompt.values())
        return p.UsageInfo(
            prompt_tokens=prompt,
            completion_tokens=self.completion,
            total_tokens=prompt + self.completion,
            prompt_tokens_details=p.PromptTokensDetails(cached_tokens=sum(self.cached.values())),
        )


class Serving:
    """The generation handlers, bound to one TokenizerManager."""

    def __init__(
        self, tm: Any, metrics: ServerMetrics, log_requests: bool = True, parsers: OutputParsers | None = None
    ) -> None:
        self.tm = tm
        self.metrics = metrics
        self.log_requests = log_requests
        self.parsers = parsers if parsers is not None else OutputParsers()  # tool-call / reasoning parsers
        self._token_info: dict[int, tuple[str, list[int]]] = {}
        self._special: frozenset[int] | None = None
        # a running request of several generations (n > 1, several prompts) -> their rids, by the request's rid
        self._groups: dict[str, tuple[str, ...]] = {}

    def abort(self, rid: str) -> None:
        """/abort_request: the request with this rid, every generation of it (refuzz audit 31: with n > 1 the
        rid named none of them, and the choices ran to the end after an "ok")."""
        for one in self._groups.get(rid, (rid,)):
            self.tm.abort(one)

    # ---- shared checks ----------------------------------------------------------------------

    def check_ready(self, model: str | None) -> None:
        if not self.tm.is_healthy():
            why = getattr(self.tm, "unhealthy_reason", None)  # e.g. "the server is shutting down", as /health says
            reason = (why() if why is not None else None) or "the runtime is not healthy"
            raise APIError(f"{reason}; try again later", 503)
        if model is not None and model != self.tm.model_name:
            raise model_not_found(f"the model {model!r} does not exist; this server serves {self.tm.model_name!r}")

    def budget(self, ids: list[int], requested: int | None, names: FieldNames) -> int:
        """max_new_tokens for a tokenized prompt: its ids checked against the vocabulary, and the
        budget against the context (a 400 naming the field otherwise)."""
        limits = self.tm.limits
        try:
            check_token_ids(ids, limits, names.prompt)
            return max_new_tokens_for(len(ids), requested, limits, names)
        except InvalidRequest as e:
            raise refused(e) from None

    def prompt_logprobs(self, meta: dict, top: int | None) -> p.PromptLogprobs | None:
        """vLLM's `prompt_logprobs` of a request that asked for `top` alternatives (None: it did not):
        per prompt token None for the first, else its own entry, then its `top` likeliest alternatives'
        (ranks 1..top) where they are other tokens."""
        if top is None:
            return None
        ranks = meta.get("input_token_ranks") or []
        alternatives = meta.get("input_top_logprobs") or []
        out: p.PromptLogprobs = []
        for j, (lp, tid) in enumerate(meta.get("input_token_logprobs") or []):
            if lp is None:
                out.append(None)
                continue
            rank = ranks[j] if j < len(ranks) else None  # a runner that reports no ranks
            entry = {str(tid): p.PromptLogprob(logprob=_finite(lp), rank=rank, decoded_token=self.token_info(tid)[0])}
            alts = alternatives[j] if j < len(alternatives) else []
            for alt_rank, (alt_lp, alt) in enumerate(alts[:top], 1):
                entry.setdefault(str(alt), p.PromptLogprob(logprob=_finite(alt_lp), rank=alt_rank,
                                                           decoded_token=self.token_info(alt)[0]))
            out.append(entry)
        return out

    def token_info(self, token_id: int) -> tuple[str, list[int]]:
        """The `token` string and `bytes` of one token in logprobs. The bytes are the token's own
        (from the vocabulary: a byte-level piece or a `<0xNN>` byte-fallback token may hold part
        of a UTF-8 character), so the bytes of an output's tokens, joined, are its text's UTF-8.
        The string is their text, or, when they are not valid UTF-8 on their own, `bytes:` and
        their `\\xNN` escapes (vLLM's convention): distinct tokens never share a string."""
        info = self._token_info.get(token_id)
        if info is None:
            tok = self.tm.tokenizer
            read = getattr(tok, "token_bytes", None)
            raw = read(token_id) if read is not None else tok.decode([token_id]).encode()
            info = self._token_info[token_id] = (token_label(raw), list(raw))
        return info

    def is_special(self, token_id: int) -> bool:
        if self._special is None:
            self._special = frozenset(getattr(self.tm.tokenizer, "all_special_ids", None) or ())
        return token_id in self._special

    def sampling(
        self,
        req: p._SamplingFields,
        max_new_tokens: int,
        seed: int | None,
        logprobs: bool,
        top: int,
        plan: ChatPlan | None = None,
    ) -> SamplingParams:
        params = SamplingParams(
            max_new_tokens=max_new_tokens,
            min_new_tokens=req.min_tokens,  # more than the budget (or the context) allows: a 400 below
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=req.top_k,
            min_p=req.min_p,
            repetition_penalty=req.repetition_penalty,
            frequency_penalty=req.frequency_penalty,
            presence_penalty=req.presence_penalty,
            logit_bias=dict(req.logit_bias) if req.logit_bias else None,
            seed=seed,
            stop=req.stop_list(),
            stop_token_ids=list(req.stop_token_ids or []),
            ignore_eos=req.ignore_eos,
            skip_special_tokens=req.skip_special_tokens,
            no_stop_trim=req.include_stop_str_in_output,
            logprobs=logprobs,
            top_logprobs=top,
            json_schema=req.response_format.schema_text() if req.response_format is not None else None,
        )
        for name, value in (plan.sampling_overrides if plan else {}).items():  # tool-choice constraint
            setattr(params, name, value)
        try:
            check_sampling(params, self.tm.limits, OPENAI_FIELDS)
        except InvalidRequest as e:
            explained = plan.explain_refusal(e.param, e.message) if plan else _format_refusal(req, e)
            raise (explained or refused(e)) from None
        return params

    # ---- /v1/chat/completions ---------------------------------------------------------------

    async def chat(self, req: p.ChatCompletionRequest, raw: Request) -> Response:
        started = time.perf_counter()
        self.check_ready(req.model)
        # template, tools, constraint, parsers (a long conversation is rendered and tokenized off the loop)
        plan = await off_the_loop(req.text_chars(), plan_chat, self.tm, req, self.parsers)
        ids = plan.ids
        sent = dataclasses.replace(CHAT_FIELDS, max_new_tokens=req.max_tokens_field()[0])  # or max_completion_tokens
        max_new = self.budget(list(ids), req.requested_max_tokens(), sent)
        base = req.rid or f"chatcmpl-{uuid.uuid4().hex}"
        top = req.top_logprobs or 0
        jobs = [
            self._job(i, base, req.n, req, dict(input_ids=list(ids)), max_new, req.logprobs, top, plan=plan,
                      prompt_logprobs=req.prompt_logprobs if i == 0 else None)  # one prompt: scored once
            for i in range(req.n)
        ]
        formatter = _ChatFormat(self, base, self.tm.model_name, req, plan)
        try:
            if req.stream:
                return await self._stream(jobs, raw, formatter, "chat", started, lambda index: 0, base)
            last = await self._collect(jobs, raw, "chat", base)
        except RequestError as e:  # e.g. the runtime has no grammar backend for tool_choice=required
            explained = plan.explain_refusal(getattr(e, "param", None), e.message) if e.status == 400 else None
            raise (explained or e) from None
        tally = _Tally()
        choices = []
        for job in jobs:
            out = last[job.index]
            meta = out["meta_info"]
            tally.add(0, meta)
            reason, matched = _finish(meta)
            message = p.ChatResponseMessage(content=out["text"])
            if plan.make_output is not None:
                parts = plan.make_output().finish(out["text"], truncated=reason == "length")
                message = _message(parts)
                reason = _tool_finish(reason, bool(parts.calls), plan)
            choices.append(
                p.ChatChoice(
                    index=job.index,
                    message=message,
                    logprobs=formatter.logprobs(meta, 0) if req.logprobs else None,
                    finish_reason=reason,
                    matched_stop=matched,
                )
            )
        usage = tally.usage()
        self._done(base, "chat", 200, usage, started, None)
        body = p.ChatCompletionResponse(id=base, model=self.tm.model_name, choices=choices, usage=usage,
                                        prompt_logprobs=self.prompt_logprobs(last[jobs[0].index]["meta_info"],
                                                                             req.prompt_logprobs))
        return JSONResponse(body.model_dump())

    # ---- /v1/completions --------------------------------------------------------------------

    async def completions(self, req: p.CompletionRequest, raw: Request) -> Response:
        started = time.perf_counter()
        self.check_ready(req.model)
        prompts = req.prompts()
        base = req.rid or f"cmpl-{uuid.uuid4().hex}"
        want_lp = req.logprobs is not None
        jobs: list[Job] = []
        prompt_of: dict[int, int] = {}
        for k, prompt in enumerate(prompts):
            # text is tokenized here, so the budget is checked before any generation starts
            ids = list(prompt) if isinstance(prompt, list) else list(
                await off_the_loop(len(prompt), self.tm.tokenizer.encode, prompt))
            where = req.prompt_field(k)
            max_new = self.budget(ids, req.max_tokens, dataclasses.replace(OPENAI_FIELDS, prompt=where))
            given = dict(input_ids=ids)
            for i in range(req.n):
                index = k * req.n + i
                prompt_of[index] = k
                jobs.append(
                    self._job(
                        index,
                        base,
                        len(prompts) * req.n,
                        req,
                        given,
                        max_new,
                        want_lp,
                        req.logprobs or 0,
                        seed_offset=i,
                        prompt_logprobs=_most(req.logprobs if req.echo else None, req.prompt_logprobs),
                    )
                )
        echoes = [self._prompt_text(prm) if req.echo else "" for prm in prompts]
        formatter = _CompletionFormat(self, base, self.tm.model_name, req, echoes, prompt_of)
        try:
            if req.stream:
                return await self._stream(jobs, raw, formatter, "completions", started, prompt_of.__getitem__, base)
            last = await self._collect(jobs, raw, "completions", base)
        except RequestError as e:  # a response_format the runtime cannot compile: named as the client sent it
            raise (_format_refusal(req, e) or e) from None
        tally = _Tally()
        choices = []
        for job in jobs:
            out = last[job.index]
            meta = out["meta_info"]
            k = prompt_of[job.index]
            tally.add(k, meta)
            reason, matched = _finish(meta)
            choices.append(
                p.CompletionChoice(
                    index=job.index,
                    text=echoes[k] + out["text"],
                    logprobs=formatter.choice_logprobs(meta, k) if want_lp else None,
                    finish_reason=reason,
                    prompt_logprobs=self.prompt_logprobs(meta, req.prompt_logprobs),
                    matched_stop=matched,
                )
            )
        usage = tally.usage()
        self._done(base, "completions", 200, usage, started, None)
        body = p.CompletionResponse(id=base, model=self.tm.model_name, choices=choices, usage=usage)
        return JSONResponse(body.model_dump())

    def _prompt_text(self, prompt: str | list[int]) -> str:
        return prompt if isinstance(prompt, str) else self.tm.tokenizer.decode(prompt)

    # ---- native /generate -------------------------------------------------------------------

    async def generate(self, req: p.GenerateRequest, raw: Request) -> Response:
        """SGLang's /generate: each prompt sampled `n` times; output `k * n + i` is sample i of prompt k (SGLang's
        order). One prompt with n == 1 answers its output object (streamed: its events); a batch or n > 1 answers
        the list of outputs (streamed: each event is one output's, with its `index` in that list)."""
        started = time.perf_counter()
        self.check_ready(None)
        prompts = req.prompts()
        per_prompt = isinstance(req.sampling_params, list)
        params: list[SamplingParams] = []
        try:  # every prompt is checked before any generation starts: one bad prompt refuses the whole request
            for k, d in enumerate(req.sampling_params if per_prompt else [req.sampling_params]):
                sp = sampling_from_dict(d, self.tm.limits, _native_names(k if per_prompt else None), MAX_N)
                if req.return_logprob:
                    sp.logprobs, sp.top_logprobs = True, req.top_logprobs_num
                if params:
                    check_same_n(sp, k, params[0])
                params.append(sp)
            n = params[0].n
            too_many = p.too_many_completions(len(prompts), n)
            if too_many:
                raise InvalidRequest(too_many, "text" if req.text is not None else "input_ids")
        except InvalidRequest as e:
            raise refused(e) from None
        rids = req.rid if isinstance(req.rid, list) else None  # one per prompt
        base = req.rid if isinstance(req.rid, str) else uuid.uuid4().hex  # the request's own (/abort_request, logs)
        jobs: list[Job] = []
        prompt_of: dict[int, int] = {}
        for k, prompt in enumerate(prompts):
            sp = params[k if per_prompt else 0]
            names = dataclasses.replace(_native_names(k if per_prompt else None), prompt=req.prompt_field(k))
            # text is tokenized here, so that every prompt's budget is checked before any generation starts
            ids = list(prompt) if isinstance(prompt, list) else list(
                await off_the_loop(len(prompt), self.tm.tokenizer.encode, prompt))
            self.budget(ids, sp.max_new_tokens, names)
            try:  # seed + i may be past 64 bits: a 400 now, not the runtime's once the others run
                check_copy_seeds(sp, self.tm.limits, names)
            except InvalidRequest as e:
                raise refused(e) from None
            for i in range(n):
                index = k * n + i
                prompt_of[index] = k
                copy = sample_copy(sp, i)  # each generation makes one sample; copy i's seed is the OpenAI choice i's
                rid = choice_rid(base, len(prompts) * n, index) if rids is None else choice_rid(rids[k], n, i)
                gen = GenerateInput(
                    input_ids=ids,
                    ids_field=names.prompt,  # the runtime's errors name the prompt as the client sent it
                    sampling_params=copy,
                    rid=rid,
                    stream=req.stream,
                    return_logprob=req.return_logprob,
                    top_logprobs_num=req.top_logprobs_num,
                    logprob_start_len=req.logprob_start_len,
                    priority=req.priority,
                )
                jobs.append(Job(index, rid, gen, group=rids[k] if rids is not None and n > 1 else None,
                                sampling_field=f"sampling_params[{k}]" if per_prompt else None))
        single = not req.is_batch() and n == 1  # today's (and SGLang's) answer of one object
        if req.stream:
            fmt = _NativeFormat(indexed=not single)
            return await self._stream(jobs, raw, fmt, "generate", started, prompt_of.__getitem__, base)
        last = await self._collect(jobs, raw, "generate", base)
        tally = _Tally()
        for job in jobs:
            tally.add(prompt_of[job.index], last[job.index]["meta_info"])
        self._done(base if len(jobs) > 1 else jobs[0].rid, "generate", 200, tally.usage(), started, None)
        outs = [last[job.index] for job in jobs]
        return Response(_native_json(outs[0] if single else outs), media_type="application/json")

    # ---- plumbing ---------------------------------------------------------------------------

    def _job(
        self,
        index: int,
        base: str,
        total: int,
        req: p._SamplingFields,
        given: dict,
        max_new: int,
        logprobs: bool,
        top: int,
        seed_offset: int | None = None,
        plan: ChatPlan | None = None,
        prompt_logprobs: int | None = None,
    ) -> Job:
        rid = choice_rid(base, total, index)
        seed = copy_seed(req.seed, index if seed_offset is None else seed_offset)
        params = self.sampling(req, max_new, seed, logprobs, top, plan)
        params.prompt_logprobs = prompt_logprobs
        gen = GenerateInput(
            sampling_params=params, rid=rid, stream=req.stream, return_logprob=logprobs, top_logprobs_num=top,
            priority=req.priority, **given,
        )
        return Job(index, rid, gen)

    async def _collect(self, jobs: list[Job], raw: Request, route: str, rid: str) -> dict[int, dict]:
        """`rid`: the request's own (its generations' rids add `-<i>` when there are several)."""
        fan = Fanout(self.tm, jobs, self._groups, rid)
        self.metrics.in_flight.labels(self.metrics.model_name).inc()
        try:  # a failure's HTTP status is counted and logged by FailedRequestMiddleware
            return await until_disconnect(raw, fan.collect())
        except ClientGone:
            logger.info("request %s: client disconnected; aborted", jobs[0].rid)
            raise
        finally:
            await fan.aclose()
            self.metrics.in_flight.labels(self.metrics.model_name).dec()

    async def _stream(
        self,
        jobs: list[Job],
        raw: Request,
        fmt: _Format,
        route: str,
        started: float,
        prompt_index: Callable[[int], int],
        rid: str,
    ) -> Response:
        """Start the generations and wait for the first output, so that a rejected request is still
        an HTTP error; then stream SSE events until every choice finished. `rid`: as for `_collect`."""
        fan = Fanout(self.tm, jobs, self._groups, rid)
        iterator = fan.__aiter__()
        self.metrics.in_flight.labels(self.metrics.model_name).inc()
        try:
            first = await until_disconnect(raw, iterator.__anext__())
        except BaseException as e:
            await fan.aclose()
            self.metrics.in_flight.labels(self.metrics.model_name).dec()
            if isinstance(e, StopAsyncIteration):
                raise APIError("the runtime returned no output", 500) from None
            raise  # an HTTP error: counted and logged by FailedRequestMiddleware
        ttft = time.perf_counter() - started

        async def events() -> AsyncIterator[str]:
            states = {job.index: ChoiceState() for job in jobs}
            tally = _Tally()
            status = 200
            try:
                pending: list[tuple[int, dict]] = [first]
                while True:
                    for index, out in pending:
                        st = states[index]
                        st.last = out
                        for event in fmt.chunk(index, out, st):
                            yield event
                        if out["meta_info"].get("finish_reason") and not st.finished:
                            st.finished = True
                            tally.add(prompt_index(index), out["meta_info"])
                    pending = []
                    try:
                        pending.append(await iterator.__anext__())
                    except StopAsyncIteration:
                        break
                for event in fmt.end(tally.usage()):
                    yield event
            except RequestError as e:
                status = e.status
                yield sse(json.dumps(error_body(e.message, e.status)))
            except Exception as e:  # mid-stream failure: the client gets an error event, not a cut stream
                status = 500
                logger.exception("request %s failed while streaming", jobs[0].rid)
                yield sse(json.dumps(error_body(f"internal error: {e}", 500)))
            except BaseException:
                status = 499  # cancelled: the client disconnected
                logger.info("request %s: client disconnected while streaming; aborted", jobs[0].rid)
                raise
            finally:
                await fan.aclose()
                self.metrics.in_flight.labels(self.metrics.model_name).dec()
                for index, st in states.items():  # usage of unfinished choices, for the log line
                    if not st.finished and st.last:
                        tally.add(prompt_index(index), st.last["meta_info"])
                self._done(jobs[0].rid, route, status, tally.usage(), started, ttft)
            yield sse("[DONE]")

        return StreamingResponse(events(), media_type="text/event-stream", headers=_SSE_HEADERS)

    def _done(self, rid: str, route: str, status: int, usage: p.UsageInfo, started: float, ttft: float | None) -> None:
        latency = time.perf_counter() - started
        cached = usage.prompt_tokens_details.cached_tokens
        self.metrics.observe_request(route, status, usage.prompt_tokens, usage.completion_tokens, cached, latency, ttft)
        if self.log_requests:
            logger.info(
                "request %s %s status=%d prompt_tokens=%d completion_tokens=%d cached_tokens=%d latency=%.3fs%s",
                rid,
                route,
                status,
                usage.prompt_tokens,
                usage.completion_tokens,
                cached,
                latency,
                "" if ttft is None else f" ttft={ttft:.3f}s",
            )


def _native_json(out: dict | list[dict]) -> bytes:
    return (
        json.dumps(out, default=_json_default, allow_nan=False).encode()
        if _all_finite(out)
        else json.dumps(_sanitize(out), default=_json_default).encode()
    )


def _json_default(o: Any) -> Any:
    if hasattr(o, "tolist"):
        return o.tolist()
    raise TypeError(f"not JSON serializable: {type(o).__name__}")


def _all_finite(o: Any) -> bool:
    if isinstance(o, float):
        return math.isfinite(o)
    if isinstance(o, dict):
        return all(_all_finite(v) for v in o.values())
    if isinstance(o, list | tuple):
        return all(_all_finite(v) for v in o)
    return True


def _sanitize(o: Any) -> Any:
    if isinstance(o, float):
        return _finite(o)
    if isinstance(o, dict):
        return {k: _sanitize(v) for k, v in o.items()}
    if isinstance(o, list | tuple):
        return [_sanitize(v) for v in o]
    return o


# ---- stream formats --------------------------------------------------------------------------


class _Format:
    cached_floor: dict[int, int]  # prompt index -> the fewest cached tokens its choices had so far

    def chunk(self, index: int, out: dict, st: ChoiceState) -> list[str]:
        raise NotImplementedError

    def end(self, usage: p.UsageInfo) -> list[str]:
        return []

    def running_usage(self, meta: dict, prompt_index: int = 0) -> p.UsageInfo | None:
        """Usage so far, for every chunk when the client asked for continuous_usage_stats."""
        opts = getattr(self.req, "stream_options", None)
        if not (opts and opts.continuous_usage_stats):
            return None
        # cached tokens on the final usage's basis (_Tally): the fewest any choice of the prompt had so far
        cached = int(meta.get("cached_tokens", 0))
        floor = self.cached_floor[prompt_index] = min(self.cached_floor.get(prompt_index, cached), cached)
        tally = _Tally()
        tally.add(0, {**meta, "cached_tokens": floor})
        return tally.usage()


def token_label(raw: bytes) -> str:
    """A token's string in logprobs: its text, or `bytes:\\xf0\\x9f` when its bytes are not
    valid UTF-8 on their own (part of a character)."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def _reported(meta: dict) -> int:
    """How many of the output's tokens chat logprobs report: all but the token that ended the
    generation when its text is not part of the content (EOS or a stop token id; the detokenizer
    leaves it out of the text), as OpenAI's chat does. Text completions report that token too (see
    `_CompletionFormat.logprobs`). A stop string's tokens are already left out."""
    pairs = meta.get("output_token_logprobs") or []
    n = len(pairs)
    fr = meta.get("finish_reason") or {}
    matched = fr.get("matched")
    if n and fr.get("type") == "stop" and isinstance(matched, int) and not isinstance(matched, bool):
        if pairs[-1][1] == matched:
            n -= 1
    return n


def _joined(first: p.CompletionLogprobs, then: p.CompletionLogprobs) -> p.CompletionLogprobs:
    return p.CompletionLogprobs(tokens=first.tokens + then.tokens, token_logprobs=first.token_logprobs + then.token_logprobs,
                                top_logprobs=first.top_logprobs + then.top_logprobs,
                                text_offset=first.text_offset + then.text_offset)


def _pairs(meta: dict, key: str, start: int, end: int | None) -> list:
    return list(meta.get(key) or [])[start:end]


def _message(parts) -> p.ChatResponseMessage:
    calls = [pt.ToolCall(id=c.id, function=pt.FunctionCall(name=c.name, arguments=c.arguments)) for c in parts.calls]
    return p.ChatResponseMessage(content=parts.content, reasoning_content=parts.reasoning, tool_calls=calls or None)


def _format_refusal(req: p._SamplingFields, e: RequestError) -> APIError | None:
    """A 400 about the json_schema constraint of a request whose `response_format` set it, as a
    refusal of `response_format` (None: another error)."""
    fmt = req.response_format
    if e.status != 400 or fmt is None or fmt.schema_text() is None:
        return None
    return response_format_refusal(getattr(e, "param", None), e.message)


def _tool_finish(reason: str | None, has_calls: bool, plan: ChatPlan) -> str | None:
    """OpenAI ends a turn that called tools with finish_reason "tool_calls", except under a named
    tool_choice, where it says "stop" (streamed or not; vLLM matches it too)."""
    return "tool_calls" if has_calls and reason == "stop" and plan.tool_choice != "named" else reason


class _ChatFormat(_Format):
    def __init__(
        self, serving: Serving, rid: str, model: str, req: p.ChatCompletionRequest, plan: ChatPlan | None = None
    ) -> None:
        self.s, self.rid, self.model, self.req = serving, rid, model, req
        self.created = int(time.time())
        self.top = req.top_logprobs or 0
        self.plan = plan
        self.cached_floor = {}
        self.outputs: dict[int, ChoiceOutput] = {}  # per choice, when tools or reasoning are parsed

    def logprobs(self, meta: dict, start: int) -> p.ChatLogprobs:
        end = _reported(meta)
        tokens = _pairs(meta, "output_token_logprobs", start, end)
        tops = _pairs(meta, "output_top_logprobs", start, end)
        content = []
        for j, (lp, tid) in enumerate(tokens):
            text, raw = self.s.token_info(tid)
            alts = tops[j] if j < len(tops) and tops[j] else []
            top = []
            for a, t in alts[: self.top]:
                alt_text, alt_raw = self.s.token_info(t)
                top.append(p.TopLogprob(token=alt_text, logprob=_finite(a), bytes=list(alt_raw)))
            content.append(p.ChatTokenLogprob(token=text, logprob=_finite(lp), bytes=list(raw), top_logprobs=top))
        return p.ChatLogprobs(content=content)

    def _event(self, choice: p.ChatChunkChoice, usage: p.UsageInfo | None = None) -> str:
        chunk = p.ChatCompletionChunk(
            id=self.rid, created=self.created, model=self.model, choices=[choice], usage=usage
        )
        return sse(chunk.model_dump_json())

    def chunk(self, index: int, out: dict, st: ChoiceState) -> list[str]:
        # the role rides on the first chunk, which is sent with the first token (not a separate
        # empty event: load clients would count it as a token and skew TTFT / ITL)
        role = None
        if not st.started:
            st.started = True
            role = "assistant"
        meta = out["meta_info"]
        text = out["text"]
        delta, st.text_len = text[st.text_len :], len(text)
        logprobs = None
        if self.req.logprobs:
            logprobs = self.logprobs(meta, st.logprobs_sent)
            st.logprobs_sent += len(logprobs.content)
        reason, matched = _finish(meta)
        usage = self.running_usage(meta)
        if self.plan is not None and self.plan.make_output is not None:
            return self._parsed_chunks(index, text, role, logprobs, reason, matched, usage)
        if not (role or delta or reason or (logprobs and logprobs.content)):
            return []
        choice = p.ChatChunkChoice(
            index=index,
            delta=p.DeltaMessage(role=role, content=delta),
            logprobs=logprobs,
            finish_reason=reason,
            matched_stop=matched,
        )
        return [self._event(choice, usage)]

    def _parsed_chunks(self, index, text, role, logprobs, reason, matched, usage) -> list[str]:
        """Reasoning, content and tool-call deltas of one step: the text and reasoning ride on one
        event; each call's start and each argument fragment is an event of its own (a call's first
        delta carries id, type and name, as OpenAI streams them); the finish reason rides on the
        last event."""
        output = self.outputs.get(index)
        if output is None:
            output = self.outputs[index] = self.plan.make_output()
        d = output.delta(text, final=reason is not None, truncated=reason == "length")
        deltas = []
        if role or d.reasoning or d.content or not d.calls:
            deltas.append(p.DeltaMessage(role=role, content=d.content or None, reasoning_content=d.reasoning or None))
        for c in d.calls:
            call = pt.DeltaToolCall(
                index=c.index,
                id=c.id,
                type="function" if c.id else None,
                function=pt.DeltaFunctionCall(name=c.name, arguments=c.arguments),
            )
            deltas.append(p.DeltaMessage(tool_calls=[call]))
        has_lp = bool(logprobs and logprobs.content)
        if not (role or d.reasoning or d.content or d.calls or reason or has_lp):
            return []
        reason = _tool_finish(reason, output.has_calls, self.plan)
        events = []
        for k, delta in enumerate(deltas):
            last = k == len(deltas) - 1
            choice = p.ChatChunkChoice(
                index=index,
                delta=delta,
                logprobs=logprobs if k == 0 else None,
                finish_reason=reason if last else None,
                matched_stop=matched if last else None,
            )
            events.append(self._event(choice, usage if last else None))
        return events

    def end(self, usage: p.UsageInfo) -> list[str]:
        if self.req.stream_options and self.req.stream_options.final_usage:
            chunk = p.ChatCompletionChunk(id=self.rid, created=self.created, model=self.model, choices=[], usage=usage)
            return [sse(chunk.model_dump_json())]
        return []


class _TextOffsets:
    """`text_offset` of a completion's tokens: where in the text each token's text starts. Counted
    in characters of the decoded text, so a token that holds part of a character (its first
    bytes or the rest) is at that character."""

    def __init__(self, offset: int) -> None:
        self.offset = offset
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def advance(self, raw: bytes) -> int:
        at = self.offset
        self.offset += len(self._utf8.decode(raw))  # the characters these bytes complete
        return at


class _CompletionFormat(_Format):
    def __init__(
        self,
        serving: Serving,
        rid: str,
        model: str,
        req: p.CompletionRequest,
        echoes: list[str],
        prompt_of: dict[int, int],
    ) -> None:
        self.s, self.rid, self.model, self.req = serving, rid, model, req
        self.echoes, self.prompt_of = echoes, prompt_of
        self.created = int(time.time())
        self.cached_floor = {}
        self.top = req.logprobs or 0
        self.skip_special = req.skip_special_tokens
        self._offsets: dict[int, _TextOffsets] = {}

    def logprobs(self, meta: dict, start: int, offsets: _TextOffsets) -> p.CompletionLogprobs:
        """The output tokens' entries from the `start`-th on: every generated token, the EOS or stop
        token id that ended the output included (its text is not in `text`; its offset is the text's
        end), as OpenAI's legacy completions and vLLM report it. Clients count on one entry per
        generated token: lm-evaluation-harness scores a continuation as `token_logprobs[ctxlen:-1]`
        of an `echo` request with `max_tokens: 1`, dropping the one generated token whatever it is."""
        tokens = _pairs(meta, "output_token_logprobs", start, None)
        tops = _pairs(meta, "output_top_logprobs", start, None)
        out = p.CompletionLogprobs()
        fr = meta.get("finish_reason") or {}
        stopped_on = fr.get("matched") if fr.get("type") == "stop" else None
        last = len(meta.get("output_token_logprobs") or []) - 1 - start
        for j, (lp, tid) in enumerate(tokens):
            # not in the text: a special token skipped by the detokenizer, or the stop token id that ended it
            in_text = not (self.skip_special and self.s.is_special(tid)) and not (j == last and tid == stopped_on)
            self._add(out, tid, _finite(lp), tops[j] if j < len(tops) else None, offsets, in_text)
        return out

    def echo_logprobs(self, meta: dict) -> p.CompletionLogprobs:
        """`echo` with `logprobs`: an entry per prompt token, as OpenAI gives them (the first token's
        logprob and alternatives are null: nothing precedes it); offsets from the echoed text's start."""
        tops = meta.get("input_top_logprobs") or []
        out = p.CompletionLogprobs()
        offsets = _TextOffsets(0)
        for j, (lp, tid) in enumerate(meta.get("input_token_logprobs") or []):
            self._add(out, tid, None if lp is None else _finite(lp), tops[j] if j < len(tops) else None, offsets, True)
            if lp is None:
                out.top_logprobs[-1] = None
        return out

    def choice_logprobs(self, meta: dict, prompt_index: int) -> p.CompletionLogprobs:
        """A whole (not streamed) choice's logprobs: the echoed prompt's entries, then the output's."""
        output = self.logprobs(meta, 0, _TextOffsets(len(self.echoes[prompt_index])))
        return _joined(self.echo_logprobs(meta), output) if self.req.echo else output

    def _add(self, out: p.CompletionLogprobs, tid: int, lp: float | None, alts, offsets: _TextOffsets,
             in_text: bool) -> None:
        text, raw = self.s.token_info(tid)
        out.tokens.append(text)
        out.token_logprobs.append(lp)
        top: dict[str, float] = {}
        for a, t in (alts or [])[: self.top]:
            top.setdefault(self.s.token_info(t)[0], _finite(a))  # the likelier one, should two share a string
        if lp is not None:  # as OpenAI and vLLM: the chosen token is always there (up to logprobs + 1 entries)
            top.setdefault(text, lp)
        out.top_logprobs.append(top)
        out.text_offset.append(offsets.advance(bytes(raw) if in_text else b""))

    def chunk(self, index: int, out: dict, st: ChoiceState) -> list[str]:
        meta = out["meta_info"]
        prefix = ""
        first = not st.started
        if first:
            st.started = True
            prefix = self.echoes[self.prompt_of[index]]
            self._offsets[index] = _TextOffsets(len(prefix))
        text = out["text"]
        delta, st.text_len = prefix + text[st.text_len :], len(text)
        logprobs = None
        if self.req.logprobs is not None:
            logprobs = self.logprobs(meta, st.logprobs_sent, self._offsets[index])
            st.logprobs_sent += len(logprobs.tokens)
            if first and self.req.echo:  # the echoed prompt's entries come with its text
                logprobs = _joined(self.echo_logprobs(meta), logprobs)
        reason, matched = _finish(meta)
        if not (delta or reason or (logprobs and logprobs.tokens)):
            return []
        chunk = p.CompletionResponse(
            id=self.rid,
            created=self.created,
            model=self.model,
            choices=[
                p.CompletionChoice(
                    index=index, text=delta, logprobs=logprobs, finish_reason=reason, matched_stop=matched
                )
            ],
            usage=self.running_usage(meta, self.prompt_of[index]),
        )
        return [sse(chunk.model_dump_json())]

    def end(self, usage: p.UsageInfo) -> list[str]:
        if self.req.stream_options and self.req.stream_options.final_usage:
            chunk = p.CompletionResponse(id=self.rid, created=self.created, model=self.model, choices=[], usage=usage)
            return [sse(chunk.model_dump_json())]
        return []


class _NativeFormat(_Format):
    """SGLang's native stream: every event carries the full text so far and the meta_info. `indexed` (a
    batch, or n > 1): each event is one output's, with its `index` in the non-streamed answer's list, as
    SGLang adds it."""

    def __init__(self, indexed: bool) -> None:
        self.indexed = indexed

    def chunk(self, index: int, out: dict, st: ChoiceState) -> list[str]:
        return [sse(_native_json({**out, "index": index} if self.indexed else out).decode())]
