"""`radixserve bench one-batch`: prefill latency and decode step time of a static batch, in-process.

Runs the ModelRunner directly (no scheduler), so it measures the model + attention + sampler path:
for each batch size, one prefill of `input_len` tokens per request, then `output_len` decode steps.
Prints a table and optionally appends JSON lines to --result-file.

With speculative decoding (`--speculative NAME` or `stack.speculative`), the batch runs through the
in-process Scheduler instead (verify steps need it): two untimed passes generate the greedy outputs
(and teach the `oracle` drafter its continuations), the third pass is timed. Its decode steps are
scheduler steps (a verify, or a plain decode where no request got a draft), host work included:
the row gives their median and mean time, the tokens a step produced on average, tok/s as tokens
over the steps' summed time (= tokens per step / mean step time), and the acceptance length, which
counts verify steps only (docs/benchmarks.md)."""

from __future__ import annotations

import argparse
import json
import statistics
import time

from radixserve.config import Config


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="HF directory, .gguf file, or (with --load-format dummy) a config directory")
    p.add_argument("--config", help="YAML stack")
    p.add_argument("--load-format", choices=["auto", "safetensors", "gguf", "dummy"], default=None)
    p.add_argument("--model-impl", choices=["auto", "native", "transformers"], default=None,
                   help="model.impl: native plugin or the transformers fallback")
    p.add_argument("--batch-size", type=int, nargs="+", default=[1], help="batch sizes to run (default 1)")
    p.add_argument("--input-len", type=int, default=512,
                   help="prompt tokens per request (default 512: batch 32 is 16k prompt tokens, minutes on a small CPU)")
    p.add_argument("--output-len", type=int, default=64, help="tokens generated per request (default 64)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default=None)
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default=None)
    p.add_argument("--disable-cuda-graph", action="store_true")
    p.add_argument("--result-file", help="append one JSON line per batch size")
    p.add_argument("--speculative", metavar="NAME", help="drafter (stack.speculative), e.g. oracle or ngram")
    p.add_argument("--speculative-num-draft-tokens", type=int, metavar="K", help="speculative.num_draft_tokens")
    p.add_argument("-p", action="append", metavar="no:PLUGIN", help="do not load this plugin (repeatable)")
    p.add_argument("overrides", nargs="*", default=[], metavar="section.key=value")


def _config(args: argparse.Namespace) -> Config:
    from radixserve.cli import load_config_from_args

    cli: dict = {"model": {}, "runtime": {}, "scheduler": {}}
    if args.model:
        cli["model"]["path"] = args.model
    if args.load_format:
        cli["model"]["load_format"] = args.load_format
    if getattr(args, "model_impl", None):
        cli["model"]["impl"] = args.model_impl
    if args.device:
        cli["runtime"]["device"] = args.device
    if args.dtype:
        cli["runtime"]["dtype"] = args.dtype
    if args.disable_cuda_graph:
        cli["runtime"]["cuda_graph"] = False
    if getattr(args, "speculative", None):
        cli["stack"] = {"speculative": args.speculative}
    if getattr(args, "speculative_num_draft_tokens", None):
        cli["speculative"] = {"num_draft_tokens": args.speculative_num_draft_tokens}
    max_bs = max(args.batch_size)
    need = max_bs * (args.input_len + args.output_len + 80) + 64  # + draft slots of a verify
    cli["scheduler"] = {"max_running_requests": max_bs, "max_total_tokens": need}
    return load_config_from_args(args, cli)  # YAML < overrides < these flags; -p no:NAME disables a plugin


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
        if config.stack.speculative is not None:
            _report(args, _speculative_row(config, runner, prompts, args))
            continue
        # warm-up (kernels compiled, graphs captured) on other prompts of the same shape
        warm = [torch.randint(10, runner.vocab_size - 10, (args.input_len,), generator=gen).tolist() for _ in range(bs)]
        run_static_batch(runner, warm, max_new_tokens=2)
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
        _report(args, row, printed=True)
    return 0


def _report(args: argparse.Namespace, row: dict, printed: bool = False) -> None:
    if not printed:  # speculative: steps differ (verifies of any length, plain decodes), so say what each number is
        print(
            f"bs={row['batch_size']:4d} speculative={row['speculative']} decode {row['decode_steps']} steps: "
            f"p50 {row['decode_ms_per_step_p50']:.3f} ms/step, mean {row['decode_ms_per_step_mean']:.3f} ms/step, "
            f"{row['decode_tokens_per_step']:.2f} tok/step -> {row['decode_tok_s']:.1f} tok/s (tokens / summed step "
            f"time)  accept_length {row['spec_accept_length']:.2f} (tokens per request verify, {row['spec_verifies']} "
            "verifies; plain decodes not counted)"
        )
    if args.result_file:
        with open(args.result_file, "a") as f:
            f.write(json.dumps(row) + "\n")


def _speculative_row(config: Config, runner, prompts: list[list[int]], args: argparse.Namespace) -> dict:
    """Greedy generation of `prompts` through the Scheduler with the configured drafter: one
    untimed pass, then a timed one. Decode time counts the steps after every request has its
    first token (verify steps, and plain decode steps where no request got a draft)."""
    from radixserve.plugins.registry import Registry
    from radixserve.runtime.messages import GenerateRequest
    from radixserve.scheduler import Scheduler
    from radixserve.state import SamplingParams

    sched = Scheduler.from_config(config, runner, Registry.from_config(config))

    def one_pass(tag: str) -> tuple[list[float], int, int, int]:
        for i, p in enumerate(prompts):
            sp = SamplingParams(max_new_tokens=args.output_len, temperature=0.0, ignore_eos=True)
            sched.add_request(GenerateRequest(rid=f"{tag}{i}", input_ids=p, sampling_params=sp))
        m = sched.metrics
        steps: list[float] = []
        tokens = verifies = accepted = 0
        while sched.has_work():
            # every request is past its prefill (has its first token) and still decoding
            timed = not sched.waiting and sched.chunked_req is None and len(sched.running) == len(prompts)
            before = (m.generated_tokens, m.spec_verifies, m.spec_accepted_tokens)
            t0 = time.perf_counter()
            sched.step()
            if timed:  # counters of the timed steps only: the steps after a request finished are not timed
                steps.append(time.perf_counter() - t0)
                tokens += m.generated_tokens - before[0]
                verifies += m.spec_verifies - before[1]
                accepted += m.spec_accepted_tokens - before[2]
        sched.flush_cache()
        return steps, tokens, verifies, accepted

    # two untimed passes: the first teaches the oracle the plain greedy outputs, the second the
    # outputs of the verify path itself (on a GPU in bf16 the two can differ at near-ties)
    one_pass("warm")
    one_pass("warm2")
    steps, tokens, verifies, accepted = one_pass("run")
    total = sum(steps) or float("nan")
    bs = len(prompts)
    nan = float("nan")
    return {
        "batch_size": bs,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "speculative": config.stack.speculative,
        "num_draft_tokens": config.speculative.num_draft_tokens,
        "decode_steps": len(steps),  # scheduler steps: verifies and plain decodes
        "decode_ms_per_step_p50": round(statistics.median(steps) * 1e3, 3) if steps else nan,
        "decode_ms_per_step_mean": round(total / len(steps) * 1e3, 3) if steps else nan,
        "decode_tokens_per_step": round(tokens / len(steps), 3) if steps else nan,  # over the batch
        "decode_tok_s": round(tokens / total, 1),  # = decode_tokens_per_step / mean step time
        "spec_accept_length": round((accepted + verifies) / verifies, 3) if verifies else 0.0,
        "spec_verifies": verifies,
        "device": str(runner.device),
        "dtype": str(runner.dtype),
        "cuda_graph": runner.last_run_used_cuda_graph,  # the last step's (a verify as decode rows can replay one)
        "model": runner.model_path,
    }
