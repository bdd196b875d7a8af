"""CPU, SmolLM2-135M Q4_1 GGUF: a batched step with the blocks kept quantized vs dequantized at load,
both runners in one process and measured interleaved (A/B in the same minutes on a shared machine).

    python benchmarks/cpu_gguf_batch_step.py [--batch 64] [--input 64] [--steps 16] [--rounds 3] [--threads 2]

Per round and side: one static batch (`--batch` random prompts of `--input` tokens, a prefill then
`--steps` decode steps); prints the prefill time and the median decode step (wall and process CPU
time: CPU time is less disturbed by other processes), and the kept / fp32 ratio of decode tokens/s.
The offline figure of the results file (benchmarks/cpu_gguf_quantized.py) is the Engine's version."""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--input", type=int, default=64)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", default=None)
    args = ap.parse_args()
    from cpu_gguf_quantized import smollm2_path
    from radixserve.config import Config
    from radixserve.model_runner import ModelRunner
    from radixserve.static_batch import StaticBatch

    path = args.model or smollm2_path()
    runners = {}
    for side, dequantize in (("kept", False), ("fp32", True)):
        cfg = Config.build({"model": {"path": path, "weight_source_options": {"dequantize": dequantize}},
                            "runtime": {"device": "cpu", "dtype": "float32", "num_threads": args.threads},
                            "scheduler": {"max_total_tokens": args.batch * (args.input + args.steps + 8),
                                          "max_running_requests": args.batch}})
        runners[side] = ModelRunner(cfg, show_progress=False)
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 30000) for _ in range(args.input)] for _ in range(args.batch)]
    results: dict[str, list[float]] = {side: [] for side in runners}
    for rnd in range(args.rounds):
        for side, runner in runners.items():
            sb = StaticBatch(runner, prompts, None, args.steps + 1)
            cpu = []
            t_cpu = time.process_time()
            for _ in sb.steps():
                now = time.process_time()
                cpu.append(now - t_cpu)
                t_cpu = now
            res = sb.result
            row = {"round": rnd, "side": side, "prefill_s": round(res.prefill_s, 3),
                   "decode_step_ms": round(statistics.median(res.decode_step_s) * 1e3, 1),
                   "decode_step_cpu_ms": round(statistics.median(cpu[1:]) * 1e3, 1),
                   "load_avg_1m": round(os.getloadavg()[0], 1)}
            results[side].append(statistics.median(res.decode_step_s))
            print(json.dumps(row), flush=True)
    ratio = min(results["fp32"]) / min(results["kept"])
    print(json.dumps({"kept_over_fp32_decode_tok_s": round(ratio, 2), "batch": args.batch,
                      "threads": torch.get_num_threads()}), flush=True)


if __name__ == "__main__":
    main()
