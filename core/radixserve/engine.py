"""Engine: the offline Python API. Starts the runtime processes (no HTTP) and runs requests.

    with Engine(model=path, stack={"prefix_cache": "radix"}, scheduler={"chunked_prefill_size": 16}) as eng:
        out = eng.generate("Hello", {"max_new_tokens": 8, "temperature": 0})
        outs = eng.generate(["a", "b"], {"max_new_tokens": 8})

The TokenizerManager lives on an asyncio loop in a background thread; every public method is
thread-safe and marshals onto that loop.
"""

from __future__ import annotations

import asyncio
import atexit
import dataclasses
import os
import threading
from collections.abc import AsyncIterator, Mapping
from functools import cached_property
from pathlib import Path
from typing import Any

from radixserve.config import Config, ConfigError
from radixserve.peer_options import hint_for
from radixserve.plugins.registry import PluginError, Registry
from radixserve.runtime.tokenizer_manager import (
    CHILD_EXIT_TIMEOUT_S,
    ChildStartError,
    GenerateInput,
    PreparedRequest,
    TokenizerManager,
)
from radixserve.state import SamplingParams, sample_copy
from radixserve.validation import (
    MAX_N,
    NATIVE,
    PRIORITY_MAX,
    PRIORITY_MIN,
    FieldNames,
    InvalidRequest,
    ModelLimits,
    at_prompt,
    check_copy_seeds,
    check_one_choice,
    check_same_n,
    sampling_from_dict,
    too_many_completions,
)

# how long an interrupted call may take to clean up, e.g. a start stopping the children it began (each is
# killed after CHILD_EXIT_TIMEOUT_S); a second Ctrl-C ends the wait
SETTLE_TIMEOUT_S = 2 * CHILD_EXIT_TIMEOUT_S + 5


def _sampling_params(sp: Any, index: int | None = None, max_n: int = 1) -> SamplingParams:
    """One prompt's sampling params, checked here so a bad value is a ValueError naming the field
    (the same conversion as /generate: a json_schema dict is accepted and dumped to text); `index`: its
    place in a per-prompt list, which the field's name then carries (`sampling_params[1].temperature`);
    `max_n`: the most samples of the prompt the caller runs (`generate`: MAX_N; one request: 1)."""
    where = "sampling_params" if index is None else f"sampling_params[{index}]"
    names = NATIVE if index is None else FieldNames(prompt="input_ids", max_new_tokens=f"{where}.max_new_tokens",
                                                    sampling=f"{where}.")
    if isinstance(sp, SamplingParams):
        sp = check_one_choice(sp, names, max_n)  # the refusals a dict gets (n > 1 would be ignored)
    elif sp is not None and not isinstance(sp, Mapping):
        raise ValueError(f"{where} must be a dict (or a list of dicts, one per prompt), got {sp!r}")
    else:  # as /generate's; vocabulary and context are checked at submit
        sp = sampling_from_dict(sp, ModelLimits(), names, max_n)
    check_copy_seeds(sp, ModelLimits(), names)
    return sp


def _check_samples(inputs: list[GenerateInput], per_prompt: bool) -> None:
    """/generate's rules for `n` (audit 37b): every prompt sampled as many times (result k * n + i is sample i of
    prompt k), and at most MAX_COMPLETIONS_PER_REQUEST results in one call."""
    if per_prompt:  # (one sampling_params for all samples every prompt as many times)
        for k, inp in enumerate(inputs):
            check_same_n(inp.sampling_params, k, inputs[0].sampling_params)
    too_many = too_many_completions(len(inputs), inputs[0].sampling_params.n)
    if too_many is not None:
        raise InvalidRequest(too_many, param="sampling_params.n")


def _one_per_sample(inputs: list[GenerateInput]) -> list[GenerateInput]:
    """Each prompt's `sampling_params.n` samples as generations of one sample each, the prompt's samples
    together in prompt order (SGLang's order): sample i runs with seed + i (as the HTTP routes' `n`) and,
    when the prompt has a rid, as `<rid>-<i>`."""
    out: list[GenerateInput] = []
    for inp in inputs:
        sp = inp.sampling_params
        if sp.n == 1:
            out.append(inp)
            continue
        out.extend(dataclasses.replace(inp, sampling_params=sample_copy(sp, i),
                                       rid=None if inp.rid is None else f"{inp.rid}-{i}")
                   for i in range(sp.n))
    return out


def engine_config(model: str | Path | Mapping[str, Any] | None, config: str | Path | Config | Mapping[str, Any] | None,
                  tp_size: int | None, sections: Mapping[str, Any]) -> Config:
    """The Config an `Engine(model, config, tp_size=, **sections)` runs (see Engine)."""
    if isinstance(config, Config):
        base = config
    elif isinstance(config, Mapping):  # the YAML file's content, as a dict
        base = Config.load(None, dict(config))
    elif config is None or isinstance(config, str | Path):
        base = Config.load(config)
    else:
        raise ConfigError(f"config= takes a YAML file's path, a Config or a dict of the file's content, "
                          f"got {type(config).__name__} {config!r}")
    # Python arguments are taken as typed (a YAML file's or the command line's text is converted): a "2" or a
    # path given as a number was accepted and failed later, or as something else (audit 34)
    if tp_size is not None and (isinstance(tp_size, bool) or not isinstance(tp_size, int)):
        raise ConfigError(f"tp_size= must be an int, got {type(tp_size).__name__} {tp_size!r}")
    if model is not None and not isinstance(model, str | Path | Mapping):
        raise ConfigError(f"model= takes a checkpoint's path (a str or Path) or the model section as a dict, "
                          f"got {type(model).__name__} {model!r}")
    known = set(Config.model_fields)
    for name, value in sections.items():  # e.g. stack="lpm": say what a section must be, not dict()'s error
        if name not in known:  # a vLLM/SGLang keyword (max_model_len=...) or a typo: not a section at all
            hint = hint_for(name)
            raise ConfigError(f"Engine has no argument {name}=: " + (f"{hint}, as {_as_keyword(hint)}; "
                              if hint else "") + f"the config sections it takes are {', '.join(sorted(known))}")
        if not isinstance(value, Mapping):
            drafter = (f" (the drafter itself is stack={{'speculative': {value!r}}})"
                       if name == "speculative" and isinstance(value, str) else "")
            raise ConfigError(f"{name}= must be a dict of the {name} section's fields "
                              f"(e.g. {name}={{...}} as in the YAML), got {type(value).__name__} {value!r}{drafter}")
    overrides: dict[str, Any] = {k: dict(v) for k, v in sections.items()}
    if tp_size is not None:  # shorthand for runtime={"tp_size": N}: spawns N ranks (docs/parallelism.md)
        overrides.setdefault("runtime", {})["tp_size"] = tp_size
    if isinstance(model, Mapping):  # the model section itself: path, tokenizer, impl, ...
        overrides["model"] = dict(model)
    elif model is not None:
        overrides["model"] = {"path": str(model)}
    config = base.with_overrides(overrides) if overrides else base
    config.check_speculative_settings_used()
    return config


def _as_keyword(hint: str) -> str:
    """"model.context_length=N" in a hint -> "Engine(model={'path': ..., 'context_length': ...})": how the Engine
    spells it."""
    for word in hint.replace("(", " ").replace(")", " ").split():
        section, dot, key = word.partition(".")
        if dot and key and section in Config.model_fields:
            field = key.split("=")[0]
            if section == "model":  # the path goes in the same dict: Engine(path, model={...}) is a TypeError
                return "Engine(model={'path': ...})" if field == "path" else f"Engine(model={{'path': ..., '{field}': ...}})"
            return f"Engine(..., {section}={{'{field}': ...}})"
    return "docs/engine.md says"


def _user_error(e: ChildStartError) -> Exception:
    """What the Engine raises for a failed start: the type the checks before any process raise for the
    same mistake (ConfigError, FileNotFoundError, PluginError), else the ChildStartError itself."""
    if e.user_error_kind == "value":  # e.g. model.context_length past the model's positions
        return ConfigError(e.user_error)
    if e.user_error_kind == "file":
        return FileNotFoundError(e.user_error)
    if e.user_error_kind == "plugin":
        return PluginError(e.user_error)
    return e


class Engine:
    """`Engine(model=None, config=None, *, tp_size=None, **sections)`.

    - `model`: HF directory or .gguf file (None: `config`'s model.path, else the embedded SmolLM2),
      or the whole `model` section as a dict, e.g. `{"path": "model.rsw", "tokenizer": "tok_dir"}`.
    - `tp_size`: tensor-parallel ranks (runtime.tp_size; one process each, on this machine).
    - `config`: a YAML stack path, a `Config` or a dict of the YAML's content; `sections` are overrides named like the YAML
      sections (stack=..., scheduler=..., runtime=..., plugins=...), applied on top.
    - `generate(prompt | input_ids, sampling_params)`: one request (str / list[int]) -> dict, or a batch
      (list[str] / list[list[int]]) -> list of dicts; each dict has "text", "output_ids", "meta_info"
      (see TokenizerManager). `sampling_params` is a dict of SamplingParams fields, or one per prompt;
      `priority` an int (or one per prompt): higher is admitted first under the `priority` policy.
    - `await async_generate(..., stream=False)` -> dict; `await async_generate(..., stream=True)` ->
      async iterator of incremental outputs (each with the full text so far).
    - `abort(rid)`, `get_stats()`, `flush_cache()`, `is_healthy()`, `shutdown()`; a context manager.
    Raises `radixserve.runtime.errors.RequestError` for invalid requests.
    """

    def __init__(self, model: str | Path | Mapping[str, Any] | None = None, config: str | Path | Config | Mapping[str, Any] | None = None,
                 *, tp_size: int | None = None, **sections: Any) -> None:
        self.config = engine_config(model, config, tp_size, sections)
        # this process's registry, from the config's plugins section; the stack is checked (in the
        # TokenizerManager) before any thread, process or file is touched
        self.registry = Registry.from_config(self.config)
        self.tokenizer_manager = TokenizerManager(self.config, self.registry)
        self._closed = False
        self._owner_pid = os.getpid()  # a forked child inherits the object, not the loop thread or the runtime
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="radixserve-engine", daemon=True)
        self._thread.start()
        try:
            self._call(self.tokenizer_manager.start())  # stops what it started when it fails or is cancelled
        except ChildStartError as e:  # the model process refused a value of the user's: the documented type
            self._stop_loop()
            raise _user_error(e) from None
        except BaseException:  # a failed start, or Ctrl-C while the model loads
            self._stop_loop()
            raise
        atexit.register(self.shutdown)

    # ---- plumbing ---------------------------------------------------------------------------
    def _forked(self) -> bool:
        return os.getpid() != self._owner_pid

    def _check_usable(self) -> None:
        """RuntimeError after shutdown(), and in a forked child (engine audit 31: there every call waited forever on
        the loop thread the fork did not copy)."""
        if self._forked():
            raise RuntimeError(f"this Engine belongs to process {self._owner_pid}; a forked child cannot use it: "
                               "build an Engine in the child (or start it with the spawn method)")
        if self._closed:
            raise RuntimeError("the engine was shut down")

    def _call(self, coro: Any, timeout: float | None = None) -> Any:
        if self._closed or self._forked():
            coro.close()
            self._check_usable()
        settled = threading.Event()

        async def run() -> Any:
            try:
                return await coro
            except (SystemExit, KeyboardInterrupt) as e:
                # raised inside the loop thread (a plugin or a module calling sys.exit while the runtime starts):
                # asyncio would let it end the loop, and the caller would wait forever (engine audit 31)
                if isinstance(e, KeyboardInterrupt):
                    raise RuntimeError("interrupted inside the engine's event loop") from e
                raise RuntimeError(f"SystemExit({e.code!r}) inside the engine's event loop") from e
            finally:
                settled.set()

        fut = asyncio.run_coroutine_threadsafe(run(), self._loop)
        try:
            return fut.result(timeout)
        except BaseException:
            # Ctrl-C (or a timeout) in a blocking call: the coroutine is cancelled and cleans up before the caller
            # goes on (a generate's requests are aborted, not left running; a start stops the children it began)
            fut.cancel()
            settled.wait(SETTLE_TIMEOUT_S)
            raise

    def _stop_loop(self) -> None:
        self._closed = True
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self._loop.close()

    @cached_property
    def tokenizer(self) -> Any:
        """The model's transformers tokenizer, loaded on first use (the runtime itself encodes and
        decodes with `tokenizer_manager.tokenizer`, which gives the same ids and text without transformers)."""
        from radixserve.tokenizer import load_tokenizer

        return load_tokenizer(self.tokenizer_manager.model_path, self.config.model.tokenizer)

    # ---- requests ---------------------------------------------------------------------------
    @staticmethod
    def _inputs(
        prompt: str | list[str] | None,
        input_ids: list[int] | list[list[int]] | None,
        sampling_params: dict | list[dict] | None,
        rid: str | list[str] | None,
        stream: bool,
        return_logprob: bool,
        top_logprobs_num: int,
        priority: int | list[int] = 0,
        logprob_start_len: int = -1,
        max_n: int = 1,
    ) -> tuple[list[GenerateInput], bool]:
        if (prompt is None) == (input_ids is None):
            raise ValueError("give exactly one of prompt or input_ids")
        if prompt is not None:
            single = isinstance(prompt, str)
            if not single and (not isinstance(prompt, list | tuple) or not all(isinstance(p, str) for p in prompt)):
                raise ValueError(f"prompt must be a str or a list of str, got {prompt!r}")
            # errors about a prompt (empty, too long) name the Engine's argument, not /generate's `text`, and
            # in a batch its index, as the HTTP routes' `prompt[1]`
            items: list[dict] = [{"text": p, "text_field": "prompt" if single else f"prompt[{i}]"}
                                 for i, p in enumerate([prompt] if single else prompt)]
        else:
            if not isinstance(input_ids, list | tuple) or not all(isinstance(x, int | list | tuple) for x in input_ids):
                raise ValueError(f"input_ids must be a list of token ids or a list of such lists, got {input_ids!r}")
            if not input_ids:  # one prompt of no tokens, not a batch of none (a text batch may be empty)
                raise InvalidRequest("input_ids: the prompt is empty", "input_ids")
            single = isinstance(input_ids[0], int)
            # in a batch `input_ids[1][0]` names prompt 1's first id (audit 30: `input_ids[0]` read as prompt 0)
            items = [{"input_ids": list(ids), "ids_field": "input_ids" if single else f"input_ids[{i}]"}
                     for i, ids in enumerate([input_ids] if single else input_ids)]
        n = len(items)
        sps = sampling_params if isinstance(sampling_params, list) else [sampling_params] * n
        rids = rid if isinstance(rid, list) else [rid] * n
        prios = priority if isinstance(priority, list) else [priority] * n
        for field, given in (("sampling_params", sps), ("rid", rids), ("priority", prios)):
            if len(given) != n:  # a RequestError naming the field, as engine.md promises for a request's fields
                raise InvalidRequest(f"{field}: a list of {len(given)} for {n} prompts: give one for all prompts, "
                                     "or a list of one per prompt", param=field)
        if any(isinstance(p, bool) or not isinstance(p, int) for p in prios):
            raise InvalidRequest(f"priority must be an int (or one int per prompt), got {priority!r}", param="priority")
        if any(not PRIORITY_MIN <= p <= PRIORITY_MAX for p in prios):
            raise InvalidRequest(f"priority must be in [{PRIORITY_MIN}, {PRIORITY_MAX}] (a signed 32-bit int, as on "
                                 f"the HTTP routes), got {priority!r}", param="priority")
        if n > 1 and isinstance(rid, str):
            raise InvalidRequest(f"rid: a batch of {n} prompts takes a list of {n} distinct rids, got one str {rid!r}",
                                 param="rid")
        if n > 1 and rids[0] is not None and len(set(rids)) != n:
            raise InvalidRequest("rid: the rids of one batch must be distinct", param="rid")
        # the runtime caps top logprobs at 20; without this the error names sampling_params.top_logprobs
        if isinstance(top_logprobs_num, bool) or not isinstance(top_logprobs_num, int) or not 0 <= top_logprobs_num <= 20:
            raise ValueError(f"top_logprobs_num must be an int in [0, 20], got {top_logprobs_num!r}")
        return [
            GenerateInput(
                **item,
                sampling_params=_sampling_params(sp, i if isinstance(sampling_params, list) else None, max_n),
                rid=r,
                stream=stream,
                return_logprob=return_logprob,
                top_logprobs_num=top_logprobs_num,
                logprob_start_len=logprob_start_len,
                priority=prio,
            )
            for i, (item, sp, r, prio) in enumerate(zip(items, sps, rids, prios))
        ], single

    async def _collect(self, inp: GenerateInput, prepared: PreparedRequest | None = None) -> dict[str, Any]:
        last: dict[str, Any] = {}
        async for out in self.tokenizer_manager.generate(inp, prepared):
            last = out
        return last

    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict | list[dict] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        rid: str | list[str] | None = None,
        priority: int | list[int] = 0,
        logprob_start_len: int = -1,
    ) -> dict[str, Any] | list[dict[str, Any]]:
        """Run one prompt (a str, or `input_ids` a list of ids) -> its result dict, or a batch (a list of either)
        -> a list of result dicts in prompt order; blocks until all are done. Each dict has "text", "output_ids"
        and "meta_info" (docs/engine.md, "Results"). `sampling_params.n` > 1 samples a prompt n times (sample i
        with seed + i): the result is then a list, each prompt's samples together in prompt order (SGLang's).
        Ctrl-C while waiting aborts the call's requests."""
        inputs, single = self._inputs(
            prompt, input_ids, sampling_params, rid, False, return_logprob, top_logprobs_num, priority,
            logprob_start_len, max_n=MAX_N,
        )
        if any(inp.sampling_params.n > 1 for inp in inputs):
            _check_samples(inputs, isinstance(sampling_params, list))
            inputs, single = _one_per_sample(inputs), False

        async def run_all() -> list[dict[str, Any]]:
            # every prompt checked before any is sent: one bad prompt refuses the batch and nothing runs
            prepared = [await self.tokenizer_manager.prepare(i) for i in inputs]
            tasks = [asyncio.ensure_future(self._collect_at(k, i, p, single)) for k, (i, p) in
                     enumerate(zip(inputs, prepared))]
            try:
                return list(await asyncio.gather(*tasks))
            except BaseException:  # one refused by the runtime (e.g. its grammar): the others are aborted
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                raise

        results = self._call(run_all())
        return results[0] if single else results

    async def _collect_at(self, index: int, inp: GenerateInput, prepared: Any, single: bool) -> dict[str, Any]:
        """_collect for the batch's prompt `index`: a refusal that comes from the runtime (a constraint that does
        not compile) names the prompt's place, as the checks before sending do (`sampling_params[1].regex`)."""
        try:
            return await self._collect(inp, prepared)
        except InvalidRequest as e:
            if single:
                raise
            raise at_prompt(e, f"sampling_params[{index}]") from None

    async def async_generate(
        self,
        prompt: str | None = None,
        sampling_params: dict | None = None,
        input_ids: list[int] | None = None,
        stream: bool = False,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        rid: str | None = None,
        priority: int = 0,
        logprob_start_len: int = -1,
    ) -> dict[str, Any] | AsyncIterator[dict[str, Any]]:
        """One request from any event loop: the final dict, or (stream=True) an async iterator."""
        self._check_usable()  # the documented errors, not the closed (or absent) loop's
        if prompt is not None and not isinstance(prompt, str):
            raise ValueError("async_generate takes one prompt (a str); for a batch use generate(), "
                             "or asyncio.gather several async_generate calls")
        if isinstance(input_ids, list | tuple) and input_ids and not isinstance(input_ids[0], int):
            raise ValueError("async_generate takes one prompt (input_ids: a list of token ids); for a batch "
                             "use generate(), or asyncio.gather several async_generate calls")
        [inp], _ = self._inputs(
            prompt, input_ids, sampling_params, rid, stream, return_logprob, top_logprobs_num, priority, logprob_start_len
        )
        if not stream:
            fut = asyncio.run_coroutine_threadsafe(self._collect(inp), self._loop)
            return await asyncio.wrap_future(fut)
        return self._stream(inp)

    async def _stream(self, inp: GenerateInput) -> AsyncIterator[dict[str, Any]]:
        caller = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        async def pump() -> None:
            try:
                async for out in self.tokenizer_manager.generate(inp):
                    caller.call_soon_threadsafe(queue.put_nowait, ("item", out))
                caller.call_soon_threadsafe(queue.put_nowait, ("end", None))
            except Exception as e:
                caller.call_soon_threadsafe(queue.put_nowait, ("error", e))

        fut = asyncio.run_coroutine_threadsafe(pump(), self._loop)
        try:
            while True:
                kind, value = await queue.get()
                if kind == "item":
                    yield value
                elif kind == "end":
                    return
                else:
                    raise value
        finally:
            if not fut.done():
                fut.cancel()  # the consumer left early: the TokenizerManager aborts the request

    def abort(self, rid: str) -> None:
        """Abort the request with this rid: it ends with finish_reason {"type": "abort"}; an unknown or finished
        rid is ignored, as is any call after shutdown()."""
        if not self._closed and not self._forked():
            self._loop.call_soon_threadsafe(self.tokenizer_manager.abort, rid)

    def get_stats(self) -> dict[str, Any]:
        """The scheduler's statistics (what /metrics exports: running, waiting, token_usage, cache_hit_rate, ...)
        plus in_flight_requests."""
        return self._call(self.tokenizer_manager.get_stats())

    def flush_cache(self) -> bool:
        """Empty the prefix cache; False (nothing done) while requests are running or when the cache cannot
        be reset (the log says why)."""
        return self._call(self.tokenizer_manager.flush_cache()).ok

    def is_healthy(self) -> bool:
        """False after shutdown(), once a runtime process died, and in a forked child (which cannot use it)."""
        return not self._closed and not self._forked() and self.tokenizer_manager.is_healthy()

    def shutdown(self) -> None:
        """Stop the runtime's processes (requests still running end with EngineDeadError); idempotent, and run
        at interpreter exit for an engine never shut down. In a forked child it does nothing: the runtime is
        the parent's."""
        if self._closed or self._forked():
            return
        atexit.unregister(self.shutdown)
        try:
            self._call(self.tokenizer_manager.shutdown(), timeout=60)
        finally:
            self._stop_loop()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()
