"""`radixserve bench one-batch`: prefill latency and decode step time of a static batch, in-process.

Runs the ModelRunner directly (no scheduler), so it measures the model + attention + sampler path:
for each batch size, one prefill of `input_len` tokens per request, then `output_len` decode steps.
Prints a table and optionally appends JSON lines to --result-file."""

from __future__ import annotations

import argparse
import json
import statistics
import time

from radixserve.config import Config, deep_merge, parse_dotted_overrides


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="HF directory, .gguf file, or (with --load-format dummy) a config directory")
    p.add_argument("--config", help="YAML stack")
    p.add_argument("--load-format", choices=["auto", "safetensors", "gguf", "dummy"], default=None)
    p.add_argument("--batch-size", type=int, nargs="+", default=[1], help="batch sizes to run")
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default=None)
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default=None)
    p.add_argument("--disable-cuda-graph", action="store_true")
    p.add_argument("--result-file", help="append one JSON line per batch size")
    p.add_argument("overrides", nargs="*", metavar="section.key=value")


def _config(args: argparse.Namespace) -> Config:
    over: dict = parse_dotted_overrides(args.overrides or [])
    cli: dict = {"model": {}, "runtime": {}, "scheduler": {}}
    if args.model:
        cli["model"]["path"] = args.model
    if args.load_format:
        cli["model"]["load_format"] = args.load_format
    if args.device:
        cli["runtime"]["device"] = args.device
    if args.dtype:
        cli["runtime"]["dtype"] = args.dtype
    if args.disable_cuda_graph:
        cli["runtime"]["cuda_graph"] = False
    max_bs = max(args.batch_size)
    need = max_bs * (args.input_len + args.output_len) + 64
    cli["scheduler"] = {"max_running_requests": max_bs, "max_total_tokens": need}
    return Config.load(args.config, deep_merge(deep_merge(over, cli), {}))


def run(args: argparse.Namespace) -> int:
    import torch

    from radixserve.model_runner import ModelRunner
    from radixserve.static_batch import run_static_batch

    config = _config(args)
    t0 = time.perf_counter()
    runner = ModelRunner(config)
    load_s = time.perf_counter() - t0
    print(f"loaded {runner.model_path} in {load_s:.1f}s on {runner.device} ({runner.dtype})")
    for bs in args.batch_size:
        gen = torch.Generator().manual_seed(bs)
        prompts = [
            torch.randint(10, runner.vocab_size - 10, (args.input_len,), generator=gen).tolist() for _ in range(bs)
        ]
        run_static_batch(runner, prompts, max_new_tokens=2)  # warm-up (kernels compiled, graphs captured)
        res = run_static_batch(runner, prompts, max_new_tokens=args.output_len)
        step_ms = statistics.median(res.decode_step_s) * 1e3
        row = {
            "batch_size": bs,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "prefill_s": round(res.prefill_s, 4),
            "prefill_tok_s": round(bs * args.input_len / res.prefill_s, 1),
            "decode_ms_per_step_p50": round(step_ms, 3),
            "decode_tok_s": round(bs * 1e3 / step_ms, 1),
            "device": str(runner.device),
            "dtype": str(runner.dtype),
            "cuda_graph": res.used_cuda_graph,
            "model": runner.model_path,
        }
        print(
            f"bs={bs:4d} prefill {row['prefill_s'] * 1e3:9.1f} ms ({row['prefill_tok_s']:.0f} tok/s)  "
            f"decode {step_ms:8.3f} ms/step  {row['decode_tok_s']:.1f} tok/s  graph={res.used_cuda_graph}"
        )
        if args.result_file:
            with open(args.result_file, "a") as f:
                f.write(json.dumps(row) + "\n")
    return 0
