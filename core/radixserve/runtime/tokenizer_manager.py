"""TokenizerManager: the main-process front of the runtime (used by the Engine and the HTTP server)."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import os
import subprocess
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from radixserve.config import Config, ConfigError, check_cache_dir
from radixserve.model_loader.model_files import (
    check_model_files,
    check_tokenizer_present,
    check_weight_file,
    declared_architecture,
    resolve_model_path,
    served_name,
)
from radixserve.plugins.model_select import plan_model
from radixserve.plugins.registry import Registry
from radixserve.plugins.stack import check_quantization_fits, resolve_stack
from radixserve.runtime.child import (
    ChildSpec,
    kill_group,
    refuse_inside_runtime_child,
    sys_path_for_children,
    watch_exit,
)
from radixserve.runtime.child import spawn as spawn_child
from radixserve.runtime.errors import EngineDeadError, RequestError
from radixserve.runtime.ipc import PortArgs
from radixserve.runtime.messages import (
    AbortRequest,
    BatchTextOut,
    ChildFailed,
    ControlReply,
    FlushCacheRequest,
    GenerateRequest,
    ReadyMessage,
    ReqTextOut,
    ShutdownRequest,
    StatsRequest,
    make_encoder,
    manager_decoder,
)
from radixserve.serving_tokenizer import LONG_TEXT_CHARS, load_serving_tokenizer, off_the_loop
from radixserve.state import SamplingParams
from radixserve.validation import NATIVE, InvalidRequest, ModelLimits, check_text, is_text, validate_request

logger = logging.getLogger(__name__)

CHILDREN = ("scheduler", "detokenizer")
CHILD_EXIT_TIMEOUT_S = 10.0  # after a ShutdownRequest; then the child is killed


@dataclass
class GenerateInput:
    """One generation request. Exactly one of `text` / `input_ids` is given."""

    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    rid: str | None = None
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = 0
    # SGLang's: with return_logprob, >= 0 also scores the prompt, reported from this position on; -1: not
    logprob_start_len: int = -1
    priority: int = 0
    # how the caller's API names `text` / `input_ids` in errors: `/generate`'s `text`, the Engine's `prompt`
    # (`prompt[i]`, `input_ids[i]` for prompt i of a batch)
    text_field: str = "text"
    ids_field: str = "input_ids"


@dataclass(frozen=True)
class PreparedRequest:
    """A GenerateInput checked and tokenized (`TokenizerManager.prepare`), not yet sent."""

    inp: GenerateInput
    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams


@dataclass
class _ReqState:
    rid: str
    stream: bool
    return_logprob: bool
    prompt_tokens: int
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    token_logprobs: list[tuple[float, int]] = field(default_factory=list)
    top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    # SamplingParams.prompt_logprobs: the prompt, and its (logprob, token id) pairs once they arrive
    prompt_ids: list[int] | None = None
    prompt_start: int = 0  # the first prompt position reported (GenerateInput.logprob_start_len)
    prompt_logprobs: list[tuple[float | None, int]] | None = None
    prompt_ranks: list[int | None] | None = None  # each prompt token's rank (None for the first)
    prompt_top_logprobs: list[list[tuple[float, int]] | None] | None = None
    finished: bool = False


def _runtime_rejection(message: str, status: int) -> RequestError:
    """The scheduler's refusal of a request as the caller's error. A constraint that does not compile
    is reported as "<field>: ..." (scheduler/grammar.py): a 400 naming that sampling field."""
    kind = message.split(":", 1)[0]
    if status == 400 and kind in ("json_schema", "regex", "ebnf"):
        # the message starts with the field as the caller sent it, as every other 400's does
        return InvalidRequest(f"{NATIVE.sampling}{message}", NATIVE.of(kind))
    return RequestError(message, status)


async def _wait_in_thread(proc: subprocess.Popen, timeout: float | None) -> int:
    """`proc.wait(timeout)` in a plain thread, not the loop's default executor: an Engine's shutdown
    also runs from atexit, after the interpreter has shut the executors down ("cannot schedule new
    futures after shutdown")."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if not fut.done():
            fut.set_exception(error) if error is not None else fut.set_result(result)

    def wait() -> None:
        try:
            code = proc.wait(timeout)
        except BaseException as e:
            loop.call_soon_threadsafe(settle, None, e)
        else:
            loop.call_soon_threadsafe(settle, code, None)

    threading.Thread(target=wait, name="radixserve-child-wait", daemon=True).start()
    return await fut


class ChildStartError(RuntimeError):
    """A child process failed to start. `user_error`: the message of a bad value the user gave (the
    child's ChildFailed.user_error), which `serve` reports as a one-line error with exit 2; None for a crash."""

    def __init__(self, reason: str, user_error: str | None = None, user_error_kind: str | None = None) -> None:
        super().__init__(reason)
        self.user_error = user_error
        self.user_error_kind = user_error_kind  # ChildFailed.user_error_kind: "value", "file" or "plugin"


class TokenizerManager:
    """Tokenizes requests, sends them to the scheduler process, and streams results back.

    API (kept stable for the Engine and the HTTP layer):
    - `TokenizerManager(config, registry=None)` checks the stack; `await tm.start()` starts the
      scheduler and detokenizer processes (fresh interpreters, see runtime/child.py) and returns
      once the model is loaded; raises RuntimeError if a child fails.
    - `tm.tokenizer` (a `ServingTokenizer`: encode, decode, apply_chat_template, chat_template, ... as
      transformers' tokenizer of the model does them, without importing transformers or torch),
      `tm.model_name` (served name), `tm.context_len`.
    - `tm.apply_chat_template(messages, add_generation_prompt=True, **template_kwargs) -> list[int]`
      (template_kwargs: `tools=[...]`, `enable_thinking=False`, ... passed to the template).
    - `async for out in tm.generate(GenerateInput(...))`: yields dicts
      `{"text": full text so far, "output_ids": all ids so far, "meta_info": {"id", "prompt_tokens",
      "completion_tokens", "cached_tokens", "finish_reason": None | {"type": "stop"|"length"|"abort",
      "matched": token id or stop string}, with speculative decoding "spec_verify_ct" (verify steps
      with a draft) and "spec_accept_length" (mean tokens per verify step; both 0 before any), "output_token_logprobs": [(logprob, token_id), ...],
      "output_top_logprobs": [[(logprob, token_id), ...], ...]}}` (logprob keys only when
      return_logprob); with sampling_params.prompt_logprobs (or return_logprob and logprob_start_len >= 0)
      also "input_token_logprobs": [(None, first prompt id), (logprob, token_id), ...] (one per prompt
      token, from position logprob_start_len on), "input_token_ranks": [None, rank, ...] (each prompt
      token's rank among the vocabulary, 1 for the likeliest) and, when prompt_logprobs > 0,
      "input_top_logprobs": [None, [(logprob, token_id), ...], ...], from the first item on. stream=False: one item at the end; stream=True: one item per emission
      (scheduler.stream_interval steps), the last one has a finish_reason. Raises `RequestError`
      (status 400) for invalid requests, `EngineDeadError` (status 503) when a child died. Closing the
      iterator early (client disconnect) aborts the request and frees its KV.
    - `tm.abort(rid)`: the request ends with finish_reason {"type": "abort"}; unknown rids are ignored.
    - `await tm.flush_cache() -> ControlReply`: `ok` False (nothing done) while requests are running or
      when the cache cannot be reset, `data` then {"message": why, "status": 400 or 500}.
    - `await tm.get_stats() -> dict`: running, waiting, token_usage, cache_hit_rate, throughput, ...
    - `tm.is_healthy()`: False once a child died (in-flight requests then get EngineDeadError) or
      after `stop_admitting`.
    - Graceful stop: `tm.stop_admitting(reason)` (new requests: RequestError 503), `tm.in_flight()`,
      `tm.end_in_flight(reason)` (the rest end with RequestError 503).
    - `await tm.shutdown()`: stops the children and removes the ipc directory.
    All methods must be called from the event loop that ran `start()`.
    """

    def __init__(self, config: Config, registry: Registry | None = None, log_prefix: str = "") -> None:
        """`registry`: this process's plugin registry (None: built from `config`). The stack is
        checked here, before any file is read; the scheduler process builds its own from `config`.
        `log_prefix`: put before the children's log labels (a data-parallel replica's "[replica I] ")."""
        if config.runtime.dp_size > 1:  # one engine is one replica; replicas sit behind the router
            raise ConfigError(
                f"runtime.dp_size={config.runtime.dp_size}: data parallelism is served by "
                "`radixserve serve --dp N` (a router in front of N engines); one engine runs with dp_size 1"
            )
        self.config = config
        self.log_prefix = log_prefix
        self.registry = registry if registry is not None else Registry.from_config(config)
        self.stack = resolve_stack(config, self.registry, config.runtime.resolved_device())
        self.model_path = resolve_model_path(config.model.path)
        check_model_files(self.model_path)  # one line naming a broken file, before any tokenizer or process
        if config.model.load_format != "dummy":  # a file no weight source reads (a YAML as --model): named now
            check_weight_file(self.model_path, self.registry, config.model.load_format)
        check_quantization_fits(self.stack, self.model_path, self.registry, config.model.load_format)
        architecture = declared_architecture(self.model_path)
        if architecture is not None:  # model.impl against the installed plugins, before any process starts
            plan_model(self.registry, architecture, config.model.impl)
        self.model_name = served_name(self.model_path, config.model.served_model_name)
        self.tokenizer: Any = None
        self.context_len: int = 0
        self.server_info: dict[str, Any] = {}
        self.dead_reason: str | None = None
        self.on_death: list[Callable[[str], None]] = []  # e.g. the server exits non-zero
        self._rid_to_state: dict[str, _ReqState] = {}
        self._control: dict[int, asyncio.Future] = {}
        self._next_control_id = 0
        self._procs: dict[str, subprocess.Popen] = {}
        self._unwatch: dict[str, Callable[[], None]] = {}
        self._ready: dict[str, asyncio.Future] = {}
        self._started = False
        self._closing = False
        self._stopping: str | None = None  # set by stop_admitting
        self._enc = make_encoder()
        self._dec = manager_decoder()

    # ---- lifecycle --------------------------------------------------------------------------
    async def start(self) -> None:
        import zmq
        import zmq.asyncio

        refuse_inside_runtime_child()
        check_cache_dir()  # before any child: they build kernels and prepare the tokenizer there
        check_tokenizer_present(self.model_path, self.config.model.tokenizer)  # before any socket or child
        loop = asyncio.get_running_loop()
        self._loop = loop
        self._ports = PortArgs.create()
        self._zctx = zmq.asyncio.Context(1)
        self._recv = self._zctx.socket(zmq.PULL)
        self._recv.bind(self._ports.manager_input)
        self._send = self._zctx.socket(zmq.PUSH)
        self._send.connect(self._ports.scheduler_input)
        self._send_detok = self._zctx.socket(zmq.PUSH)  # only for shutdown (the scheduler may be dead)
        self._send_detok.connect(self._ports.detokenizer_input)
        self._ready = {name: loop.create_future() for name in CHILDREN}
        self._recv_task = loop.create_task(self._recv_loop())

        # the scheduler (and TP ranks) start first: their imports and the model load overlap this
        # process's tokenizer load; the detokenizer then reads the same prepared tokenizer directory
        # (prepared once per tokenizer, in a short-lived process: see serving_tokenizer.py)
        config = self.config.with_overrides({"model": {"path": self.model_path}})
        self._started = True
        layout = self._child_layout()
        try:
            for child in layout:
                if child[1] != "detokenizer":
                    self._spawn(loop, config, *child, tokenizer_path="")
            self.tokenizer = await loop.run_in_executor(
                None, load_serving_tokenizer, self.model_path, self.config.model.tokenizer
            )
            for child in layout:
                if child[1] == "detokenizer":
                    self._spawn(loop, config, *child, tokenizer_path=self.tokenizer.directory)
            infos = await asyncio.gather(*self._ready.values())
        except BaseException:
            await self.shutdown()
            raise
        self.server_info = dict(infos[0])
        self.context_len = int(self.server_info.get("context_len") or 0)

    def _spawn(self, loop: asyncio.AbstractEventLoop, config: Config, name: str, process: str, rank: int, addr: str,
               tokenizer_path: str) -> None:
        spec = ChildSpec(
            process=process,
            config=config.model_dump(mode="json"),
            ports=self._ports,
            parent_pid=os.getpid(),
            tokenizer_path=tokenizer_path,
            sys_path=sys_path_for_children(),
            tp_rank=rank,
            dist_init_addr=addr,
            log_prefix=self.log_prefix,
        )
        self._procs[name] = proc = spawn_child(spec)
        self._unwatch[name] = watch_exit(loop, proc, functools.partial(self._on_child_exit, name))

    def _child_layout(self) -> list[tuple[str, str, int, str]]:
        """(name, process kind, TP rank, rendezvous address) of each child: the scheduler (TP rank
        0), the detokenizer, and with runtime.tp_size > 1 this node's other ranks ("tp1", ...:
        they only follow rank 0, see runtime/tp.py; other nodes start theirs themselves)."""
        rt = self.config.runtime
        if rt.tp_size == 1:
            return [(name, name, 0, "") for name in CHILDREN]
        from radixserve.runtime.tp import free_local_addr, local_ranks

        addr = rt.dist_init_addr or free_local_addr()
        followers = [r for r in local_ranks(rt.tp_size, rt.nnodes, 0) if r != 0]
        return [("scheduler", "scheduler", 0, addr), ("detokenizer", "detokenizer", 0, "")] + [
            (f"tp{r}", "tp_worker", r, addr) for r in followers
        ]

    async def shutdown(self) -> None:
        import zmq

        if self._closing or not self._started:
            return
        self._closing = True
        self._fail_all(EngineDeadError("the engine is shutting down"))
        for sock in (self._send, self._send_detok):
            try:
                await sock.send(self._enc.encode(ShutdownRequest()), flags=zmq.NOBLOCK)
            except zmq.ZMQError:  # that child may already be gone
                pass
        await asyncio.gather(*(self._stop_child(name) for name in self._procs))
        self._recv_task.cancel()
        for sock in (self._recv, self._send, self._send_detok):
            sock.close(0)
        self._zctx.term()
        self._ports.cleanup()

    async def _stop_child(self, name: str) -> None:
        proc = self._procs[name]
        self._unwatch[name]()
        # a TP follower rank exits when the scheduler (rank 0) stops it, so it shares its readiness
        ready = self._ready.get(name if name in CHILDREN else "scheduler")
        if ready is None or not ready.done() or ready.cancelled() or ready.exception() is not None:
            kill_group(proc)  # still loading (it reads no messages yet) or failed: nothing to lose
        try:
            await _wait_in_thread(proc, CHILD_EXIT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            # children ignore SIGTERM (only the parent stops them), so a stuck one is killed
            logger.warning("the %s process did not exit within %.0f s; killing it", name, CHILD_EXIT_TIMEOUT_S)
            kill_group(proc)
            await _wait_in_thread(proc, None)
        # what the child left running in its group, e.g. a first start's kernel compilers (its build
        # threads die with it, their compilers would not); nothing when the group is empty
        kill_group(proc)

    def child_pids(self) -> dict[str, int]:
        """{"scheduler": pid, "detokenizer": pid, and "tp1", ... for TP ranks} of the runtime's child processes."""
        return {name: proc.pid for name, proc in self._procs.items()}

    def is_healthy(self) -> bool:
        return self._started and not self._closing and self.dead_reason is None and self._stopping is None

    def unhealthy_reason(self) -> str | None:
        """Why `is_healthy()` is false, where known: the dead child, or the shutdown in progress."""
        return self.dead_reason or self._stopping

    def stop_admitting(self, reason: str) -> None:
        """Refuse new requests (RequestError 503 with `reason`); the in-flight ones keep running."""
        self._stopping = reason

    def in_flight(self) -> int:
        """Requests admitted and not yet finished."""
        return sum(1 for st in self._rid_to_state.values() if not st.finished)

    def abort_all(self) -> int:
        """Abort every request in flight (SGLang's /abort_request `abort_all`): each ends with finish reason
        `abort`, as one aborted by its rid. Returns how many were asked to stop."""
        running = [st.rid for st in self._rid_to_state.values() if not st.finished]
        for rid in running:
            self.abort(rid)
        return len(running)

    def end_in_flight(self, reason: str) -> None:
        """End every in-flight request now with RequestError 503 `reason` (their callers see the
        error; a streaming client gets it as its final event)."""
        for st in list(self._rid_to_state.values()):
            if not st.finished:
                self.abort(st.rid)  # the scheduler stops computing it
                st.queue.put_nowait(RequestError(reason, 503))

    def _on_child_exit(self, name: str) -> None:
        proc = self._procs[name]
        self._unwatch[name]()
        if self._closing:
            return
        code = proc.wait()
        label = f"tensor-parallel rank {name[2:]} ({name})" if name.startswith("tp") else name
        reason = f"the {label} process exited unexpectedly (exit code {code})"
        if self.dead_reason is None:
            self.dead_reason = reason
        logger.error(reason)
        self._fail_all(EngineDeadError(self.dead_reason))
        for cb in self.on_death:
            cb(self.dead_reason)

    def _fail_all(self, err: Exception) -> None:
        for fut in list(self._ready.values()) + list(self._control.values()):
            if not fut.done():
                fut.set_exception(err)
        for st in self._rid_to_state.values():
            if not st.finished:
                st.queue.put_nowait(err)
        # a started future nobody awaits must not log "exception never retrieved"
        for fut in self._ready.values():
            if fut.done() and not fut.cancelled():
                fut.exception()

    def _check_alive(self) -> None:
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        if self._stopping is not None:
            raise RequestError(self._stopping, 503)
        if not self._started or self._closing:
            raise EngineDeadError("the engine is not running")

    # ---- receive loop -----------------------------------------------------------------------
    async def _recv_loop(self) -> None:
        try:
            while True:
                self._handle_message(self._dec.decode(await self._recv.recv()))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a dead receive loop would hang every request: fail them instead
            logger.exception("TokenizerManager receive loop failed")
            self.dead_reason = self.dead_reason or f"the TokenizerManager receive loop failed: {e!r}"
            self._fail_all(EngineDeadError(self.dead_reason))

    def _handle_message(self, msg: Any) -> None:
        if isinstance(msg, BatchTextOut):
            for out in msg.outs:
                self._dispatch(out)
        elif isinstance(msg, ReadyMessage):
            fut = self._ready.get(msg.process)
            if fut is not None and not fut.done():
                fut.set_result(msg.info)
        elif isinstance(msg, ControlReply):
            fut = self._control.pop(msg.req_id, None)
            if fut is not None and not fut.done():
                fut.set_result(msg)
        elif isinstance(msg, ChildFailed):
            self.dead_reason = f"the {msg.process} process failed: {msg.error}"
            fut = self._ready.get(msg.process)
            starting = fut is not None and not fut.done()
            if not (starting and msg.user_error):  # a bad value at start-up: the caller says it once
                logger.error(self.dead_reason)
            if starting:
                fut.set_exception(ChildStartError(self.dead_reason, msg.user_error, msg.user_error_kind))
                fut.exception()

    def _dispatch(self, out: ReqTextOut) -> None:
        st = self._rid_to_state.get(out.rid)
        if st is not None and not st.finished:
            if out.finished_reason is not None:
                st.finished = True
            st.queue.put_nowait(out)

    # ---- requests ---------------------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **template_kwargs) -> list[int]:
        from radixserve.tokenizer import apply_chat_template

        return apply_chat_template(self.tokenizer, messages, add_generation_prompt, **template_kwargs)

    @property
    def limits(self) -> ModelLimits:
        """The served model's vocabulary size and context length, from the scheduler's ready info."""
        return ModelLimits.from_server_info(self.server_info)

    def _prepare(self, inp: GenerateInput, text_ids: list[int] | None = None) -> tuple[str, list[int], SamplingParams]:
        if (inp.text is None) == (inp.input_ids is None):
            raise InvalidRequest("give exactly one of text or input_ids", "input_ids")
        # the prompt's errors (empty, too long, ...) name it as the caller sent it
        field = inp.text_field if inp.text is not None else inp.ids_field
        if inp.input_ids is not None:
            if not isinstance(inp.input_ids, list | tuple):
                raise InvalidRequest(f"{field} must be a list of token ids", field)
            ids = list(inp.input_ids)
        else:
            if not isinstance(inp.text, str):
                raise InvalidRequest(f"{field} must be a string", field)
            check_text(inp.text, field)  # the tokenizer would raise a TypeError on a lone surrogate
            ids = text_ids if text_ids is not None else list(self.tokenizer.encode(inp.text))
        if not ids:
            raise InvalidRequest(f"{field}: the prompt is empty", field)
        sp = inp.sampling_params
        if not isinstance(inp.return_logprob, bool):
            raise InvalidRequest(f"return_logprob must be true or false, got {inp.return_logprob!r}", "return_logprob")
        if inp.top_logprobs_num and not inp.return_logprob:  # as /generate (and OpenAI's top_logprobs): never ignored
            raise InvalidRequest("top_logprobs_num requires return_logprob", "top_logprobs_num")
        if inp.return_logprob and isinstance(sp, SamplingParams) and not sp.logprobs:
            sp = dataclasses.replace(sp, logprobs=True, top_logprobs=max(sp.top_logprobs, inp.top_logprobs_num))
        if isinstance(inp.logprob_start_len, bool) or not isinstance(inp.logprob_start_len, int) or inp.logprob_start_len < -1:
            raise InvalidRequest(f"logprob_start_len must be an int >= -1, got {inp.logprob_start_len!r}", "logprob_start_len")
        if inp.logprob_start_len >= 0:
            if not inp.return_logprob:
                raise InvalidRequest("logprob_start_len requires return_logprob", "logprob_start_len")
            if isinstance(sp, SamplingParams) and sp.prompt_logprobs is None:
                sp = dataclasses.replace(sp, prompt_logprobs=inp.top_logprobs_num)
        validate_request(ids, sp, self.limits, dataclasses.replace(NATIVE, prompt=field))
        if inp.rid is not None and not isinstance(inp.rid, str):  # the typed message to the scheduler needs a str:
            # a non-str one was dropped there, and the caller waited forever
            raise InvalidRequest(f"rid must be a string, got {type(inp.rid).__name__} {inp.rid!r}", "rid")
        rid = inp.rid or uuid.uuid4().hex
        if rid in self._rid_to_state:
            raise InvalidRequest(f"request id {rid!r} is already in use", "rid")
        return rid, ids, sp

    async def prepare(self, inp: GenerateInput) -> PreparedRequest:
        """Check and tokenize one request without sending it: a batch checks every request first, so
        that one bad prompt refuses the batch before any of it runs."""
        self._check_alive()
        text_ids = None
        if isinstance(inp.text, str) and len(inp.text) > LONG_TEXT_CHARS and is_text(inp.text):
            text_ids = list(await off_the_loop(len(inp.text), self.tokenizer.encode, inp.text))
        return PreparedRequest(inp, *self._prepare(inp, text_ids))

    async def generate(self, inp: GenerateInput, prepared: PreparedRequest | None = None) -> AsyncIterator[dict[str, Any]]:
        """Send one request (`prepared`: from `prepare(inp)`; None: prepared here) and yield its results."""
        if prepared is None:
            prepared = await self.prepare(inp)
        else:
            self._check_alive()
        rid, ids, sp = prepared.rid, prepared.input_ids, prepared.sampling_params
        if rid in self._rid_to_state:  # another request took the id since it was prepared
            raise InvalidRequest(f"request id {rid!r} is already in use", "rid")
        st = _ReqState(rid=rid, stream=inp.stream, return_logprob=sp.logprobs, prompt_tokens=len(ids),
                       prompt_ids=ids if sp.prompt_logprobs is not None else None,
                       prompt_start=max(inp.logprob_start_len, 0))
        self._rid_to_state[rid] = st
        msg = GenerateRequest(
            rid=rid,
            input_ids=ids,
            sampling_params=sp,
            stream=inp.stream,
            priority=inp.priority,
        )
        try:
            await self._send.send(self._enc.encode(msg))
            while True:
                item = await st.queue.get()
                if isinstance(item, Exception):
                    st.finished = True
                    raise item
                if item.error is not None:
                    st.finished = True
                    raise _runtime_rejection(item.error, item.error_status)
                self._accumulate(st, item)
                done = item.finished_reason is not None
                if done or st.stream:
                    yield self._render(st, item, self.config.stack.speculative is not None)
                if done:
                    return
        finally:
            if not st.finished and self.dead_reason is None and not self._closing:
                self.abort(rid)  # the caller stopped listening: free the request's KV
            self._rid_to_state.pop(rid, None)

    @staticmethod
    def _accumulate(st: _ReqState, item: ReqTextOut) -> None:
        st.text += item.text_delta
        st.output_ids.extend(item.new_ids)
        if item.token_logprobs is not None:
            st.token_logprobs.extend(zip(item.token_logprobs, item.new_ids))
        if item.top_logprobs is not None:
            st.top_logprobs.extend([[(lp, tid) for tid, lp in alts] for alts in item.top_logprobs])
        if item.prompt_token_logprobs is not None and st.prompt_ids is not None:
            # the first prompt token has no logprob (nothing before it to predict it from)
            st.prompt_logprobs = [(None, st.prompt_ids[0])] + list(zip(item.prompt_token_logprobs, st.prompt_ids[1:]))
            if item.prompt_token_ranks is not None:
                st.prompt_ranks = [None, *item.prompt_token_ranks]
            if item.prompt_top_logprobs is not None:
                st.prompt_top_logprobs = [None] + [[(lp, tid) for tid, lp in alts] for alts in item.prompt_top_logprobs]

    @staticmethod
    def _render(st: _ReqState, item: ReqTextOut, speculative: bool = False) -> dict[str, Any]:
        """The result dict; `speculative`: the server speculates, so the spec keys are always there."""
        meta: dict[str, Any] = {
            "id": st.rid,
            "prompt_tokens": st.prompt_tokens,
            "completion_tokens": item.completion_tokens or len(st.output_ids),
            "cached_tokens": item.cached_tokens,
            "finish_reason": item.finished_reason,
        }
        if speculative or item.spec_verify_ct:  # verify steps, tokens per verify (0 and 0.0 before any)
            n = item.spec_verify_ct
            meta["spec_verify_ct"] = n
            meta["spec_accept_length"] = (item.spec_accepted_drafts + n) / n if n else 0.0
        if st.return_logprob:
            meta["output_token_logprobs"] = list(st.token_logprobs)
            meta["output_top_logprobs"] = list(st.top_logprobs)
        if st.prompt_logprobs is not None:
            meta["input_token_logprobs"] = st.prompt_logprobs[st.prompt_start :]
            if st.prompt_ranks is not None:
                meta["input_token_ranks"] = st.prompt_ranks[st.prompt_start :]
            if st.prompt_top_logprobs is not None:
                meta["input_top_logprobs"] = st.prompt_top_logprobs[st.prompt_start :]
        return {"text": st.text, "output_ids": list(st.output_ids), "meta_info": meta}

    def abort(self, rid: str) -> None:
        if self.dead_reason is not None or self._closing or not self._started or not isinstance(rid, str):
            return  # (a non-str rid names no request: every rid is a str, _prepare sees to it)
        self._send.send(self._enc.encode(AbortRequest(rid)))

    async def _control_call(self, make: Callable[[int], Any]) -> ControlReply:
        self._check_alive()
        self._next_control_id += 1
        cid = self._next_control_id
        fut = self._loop.create_future()
        self._control[cid] = fut
        await self._send.send(self._enc.encode(make(cid)))
        return await fut

    async def flush_cache(self) -> ControlReply:
        return await self._control_call(FlushCacheRequest)

    async def get_stats(self) -> dict[str, Any]:
        reply = await self._control_call(StatsRequest)
        stats = dict(reply.data)
        stats["in_flight_requests"] = len(self._rid_to_state)
        return stats
