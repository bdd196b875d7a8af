"""The scheduler process: a `Scheduler` driven by messages from the TokenizerManager over ZMQ."""

from __future__ import annotations

import gc
import logging
import os
import time
from typing import Any

from radixserve.cpu_cores import set_torch_threads
from radixserve.errors import traceback_worth_showing
from radixserve.heap import release_free_heap
from radixserve.logs import configure_logging
from radixserve.runtime.child import log_level
from radixserve.runtime.ipc import PortArgs, install_parent_watchdog
from radixserve.runtime.messages import (
    AbortRequest,
    BatchTokenOut,
    ChildFailed,
    ControlReply,
    FlushCacheRequest,
    GenerateRequest,
    ReadyMessage,
    ReqTokenOut,
    ShutdownRequest,
    StatsRequest,
    make_encoder,
    scheduler_decoder,
)

logger = logging.getLogger(__name__)

STATS_HOOK_INTERVAL_S = 5.0  # how often plugins' radixserve_stats hooks get Scheduler.stats() while busy


class StatsHookReporter:
    """Hands `Scheduler.stats()` to the plugins' `radixserve_stats` hooks between steps: at most once
    per `interval_s` while the scheduler works, and once more when it goes idle (so the last
    counters arrive). `hook` is `registry.hook.radixserve_stats`, or None when no plugin implements
    it (then nothing is computed). A hook that raises is logged; serving goes on."""

    def __init__(self, hook: Any, interval_s: float = STATS_HOOK_INTERVAL_S, clock=time.monotonic) -> None:
        self.hook, self.interval_s, self.clock = hook, interval_s, clock
        self.next_due = clock()

    @classmethod
    def for_registry(cls, registry: Any, **kwargs: Any) -> StatsHookReporter:
        hook = registry.hook.radixserve_stats
        return cls(hook if hook.get_hookimpls() else None, **kwargs)

    def after_step(self, scheduler: Any, had_work: bool) -> None:
        """After one `step()`; `had_work`: whether the scheduler had work when the step began (a
        step while idle, e.g. after a control message, reports nothing)."""
        if self.hook is None or not had_work:
            return
        now = self.clock()
        if now >= self.next_due or not scheduler.has_work():  # due, or this step left it idle
            self.next_due = now + self.interval_s
            try:
                self.hook(stats=scheduler.stats())
            except Exception:
                logger.exception("a plugin's radixserve_stats hook failed (serving goes on)")


class SchedulerServer:
    """Owns the sockets; `serve_forever` alternates draining messages and `Scheduler.step()`.

    Idle means blocked in `recv` (no spinning); busy means polling the socket without waiting
    between forwards so new requests join the next batch."""

    def __init__(self, scheduler: Any, ports: PortArgs, stats_reporter: StatsHookReporter | None = None) -> None:
        import zmq

        self.scheduler = scheduler
        self.stats_reporter = stats_reporter or StatsHookReporter(None)
        self.zmq = zmq
        self.ctx = zmq.Context(1)
        self.recv = self.ctx.socket(zmq.PULL)
        self.recv.bind(ports.scheduler_input)
        self.to_detok = self.ctx.socket(zmq.PUSH)
        self.to_detok.connect(ports.detokenizer_input)
        self.to_manager = self.ctx.socket(zmq.PUSH)
        self.to_manager.connect(ports.manager_input)
        self.enc = make_encoder()
        self.dec = scheduler_decoder()
        self.running = True

    def _handle(self, msg: Any) -> None:
        s = self.scheduler
        if isinstance(msg, GenerateRequest):
            s.add_request(msg)
        elif isinstance(msg, AbortRequest):
            s.abort(msg.rid)
        elif isinstance(msg, FlushCacheRequest):
            refusal = s.flush_refusal()
            data = {} if refusal is None else {"message": refusal.message, "status": refusal.status}
            self.to_manager.send(self.enc.encode(ControlReply(req_id=msg.req_id, ok=refusal is None, data=data)))
        elif isinstance(msg, StatsRequest):
            self.to_manager.send(self.enc.encode(ControlReply(req_id=msg.req_id, data=s.stats())))
        elif isinstance(msg, ShutdownRequest):
            self.to_detok.send(self.enc.encode(ShutdownRequest()))
            self.running = False

    def _handle_safely(self, raw: bytes) -> None:
        """One bad message (undecodable, or a handler that raises) is logged once and dropped: it
        must not end the loop that serves every other request. Whoever waits on it still gets an
        answer: a failed control call replies ok=False, a failed request ends with a 500 error."""
        msg = None
        try:
            msg = self.dec.decode(raw)
            self._handle(msg)
        except Exception:
            logger.exception("scheduler: dropped a message whose handling failed")
            self._answer_failed(msg)

    def _answer_failed(self, msg: Any) -> None:
        try:
            if isinstance(msg, FlushCacheRequest | StatsRequest):
                self.to_manager.send(self.enc.encode(ControlReply(req_id=msg.req_id, ok=False)))
            elif isinstance(msg, GenerateRequest):
                self.scheduler.count_failed_admission()
                error = "internal error while admitting the request (see the server log)"
                err = ReqTokenOut(rid=msg.rid, new_ids=[], error=error, error_status=500)
                self.to_detok.send(self.enc.encode(BatchTokenOut([err])))
        except Exception:
            logger.exception("scheduler: could not answer a failed message")

    def _drain(self, block: bool) -> None:
        flags = 0 if block else self.zmq.NOBLOCK
        while self.running:
            try:
                raw = self.recv.recv(flags)
            except self.zmq.Again:
                return
            self._handle_safely(raw)
            flags = self.zmq.NOBLOCK

    def serve_forever(self) -> None:
        while self.running:
            self._drain(block=not self.scheduler.has_work())
            if not self.running:
                break
            had_work = self.scheduler.has_work()
            outs = self.scheduler.step()
            if outs:
                self.to_detok.send(self.enc.encode(BatchTokenOut(outs)))
            self.stats_reporter.after_step(self.scheduler, had_work)
        self.close()

    def close(self) -> None:
        stop = getattr(self.scheduler.runner, "stop_followers", None)
        if stop is not None:  # tensor parallelism: the other ranks exit with us
            stop()
        # after a ShutdownRequest nobody reads our outputs any more (the manager also tells the
        # detokenizer to stop): lingering would only delay the exit the parent waits for
        for sock in (self.recv, self.to_detok, self.to_manager):
            sock.close(linger=0)
        self.ctx.term()


def _build_cpu_kernels_in_background() -> None:
    """The core's native CPU kernels, compiling (first start only) while the model loads."""
    import torch

    from radixserve import native
    from radixserve.layers import cpu_gemm, cpu_greedy_head, cpu_ops
    from radixserve.sampling import cpu_draw

    probe = torch.zeros(1, 1)
    native.build_in_background(
        [lambda: cpu_ops.available(probe), lambda: cpu_gemm.pack(probe), lambda: cpu_greedy_head.pack(probe),
         lambda: cpu_draw.available(probe), cpu_gemm.amx_available]  # (AMX: built only on a CPU that has it)
    )


def _log_slow_collections(threshold_s: float = 0.005) -> None:
    """Log each garbage collection that holds the scheduler longer than `threshold_s` (it stalls
    the step it runs in, and with it every running request)."""
    started: list[float] = []

    def callback(phase: str, info: dict) -> None:
        if phase == "start":
            started[:] = [time.perf_counter()]
        elif started and time.perf_counter() - started[0] > threshold_s:
            logger.info("a generation-%d garbage collection held the scheduler %.1f ms (%d collected)",
                        info.get("generation", -1), 1000 * (time.perf_counter() - started[0]), info.get("collected", 0))

    gc.callbacks.append(callback)


def _process_start_s() -> float:
    """This process's start on the time.monotonic() clock (Linux; else now): start-up timings
    then include the interpreter's start and imports."""
    try:
        with open(f"/proc/{os.getpid()}/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        return ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.monotonic()


def run_scheduler_process(config_dict: dict, ports: PortArgs, parent_pid: int, dist_init_addr: str = "") -> None:
    """Entry point of the scheduler process (spawned by the TokenizerManager). It builds its own
    plugin registry from the config, builds the ModelRunner, reports ready (or the load error), then serves.
    With runtime.tp_size > 1 it is TP rank 0 and joins the group at `dist_init_addr` first."""
    import zmq

    from radixserve.config import Config

    install_parent_watchdog(parent_pid)
    level = log_level(config_dict)
    configure_logging(level, "scheduler")  # a no-op when spawned as a child (child.setup_logging ran first)
    config = Config.build(config_dict)
    try:
        threads_note = set_torch_threads(config.runtime.num_threads)
        if threads_note:
            logger.info(threads_note)
        from radixserve.model_runner import ModelRunner
        from radixserve.plugins.registry import Registry
        from radixserve.scheduler.scheduler import Scheduler

        registry = Registry.from_config(config, warn_unknown=False)  # this process's own, from the parent's config
        if config.runtime.resolved_device() == "cpu":
            _build_cpu_kernels_in_background()
        group = None
        if config.runtime.tp_size > 1:
            from radixserve.layers.distributed import init_tp_group

            if config.runtime.nnodes > 1:  # a rendezvous that may wait long: say for what (parallelism audit 31)
                logger.info("tensor parallelism: waiting for the %d rank(s) of nodes 1-%d at %s (at most %s s: "
                            "RADIXSERVE_DIST_TIMEOUT_S)", config.runtime.tp_size - config.runtime.tp_size
                            // config.runtime.nnodes, config.runtime.nnodes - 1, dist_init_addr,
                            os.environ.get("RADIXSERVE_DIST_TIMEOUT_S", 1800))
            group = init_tp_group(0, config.runtime.tp_size, dist_init_addr, config.runtime.resolved_device(),
                                  local_rank=0)
        # checks the whole stack before loading; the weights' progress bar is INFO-level chatter
        runner = ModelRunner(config, registry, show_progress=level <= logging.INFO, tp_group=group)
        warmup_start = time.perf_counter()
        runner.warmup()  # before "ready": the first requests must not pay for kernel compilation
        logger.info("warm-up done in %.1f s", time.perf_counter() - warmup_start)
        scheduler = Scheduler.from_config(config, runner, registry)
        server = SchedulerServer(scheduler, ports, StatsHookReporter.for_registry(registry))
        release_free_heap()  # what loading the weights freed stays resident otherwise
    except Exception as e:
        from radixserve.plugins.registry import PluginCodeError, PluginError

        # the traceback of a crash, or of a plugin's own code (the parent states a mistake of the user's once):
        # logged before the parent hears of the failure, since it then stops this process at once
        if traceback_worth_showing(e) or isinstance(e, PluginCodeError):
            logger.error("start-up failed:", exc_info=e)
        ctx = zmq.Context(1)
        sock = ctx.socket(zmq.PUSH)
        sock.connect(ports.manager_input)
        kind = ("plugin" if isinstance(e, PluginError) else "file" if isinstance(e, FileNotFoundError)
                else "value" if isinstance(e, ValueError) else None)
        sock.send(make_encoder().encode(ChildFailed(process="scheduler", error=f"{e!r}",
                                                    user_error=str(e) if kind else None, user_error_kind=kind)))
        sock.close(linger=2000)
        ctx.term()
        raise SystemExit(1) from e
    info = {
        "context_len": int(runner.context_len),
        "max_total_tokens": int(scheduler.allocator.size),
        "vocab_size": int(getattr(runner, "vocab_size", 0) or 0),
        "eos_token_ids": sorted(int(t) for t in scheduler.eos_token_ids),
        "max_running_requests": scheduler.max_running,
        "resolved_stack": runner.resolved_stack_info(),  # /server_info's: the components and their options
    }
    server.to_manager.send(server.enc.encode(ReadyMessage(process="scheduler", info=info)))
    logger.info("ready in %.1f s since the process started", time.monotonic() - _process_start_s())
    # start-up's objects (modules, the model's Python objects, the tokenizer) live as long as the
    # process: frozen, a full GC pass (which runs inside some step) scans only what serving made
    gc.collect()
    gc.freeze()
    _log_slow_collections()
    server.serve_forever()
