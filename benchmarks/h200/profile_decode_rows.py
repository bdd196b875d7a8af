"""Where a many-row decode step's time goes, per attention backend (issue 18's offline gap: on an H100 in
session 28 the offline run's decode steps at 321-384 rows took 30.9 ms on triton against 29.1 on FlashInfer).

    python benchmarks/h200/profile_decode_rows.py [--model benchmarks/model-configs/llama-3.1-8b] [--rows 320]
        [--context 1100] [--attention triton,flashinfer] [--device cuda] [--out DIR]

For each backend: one runner (dummy bf16 weights, eager: no CUDA graphs, so each kernel is profiled by name),
`rows` prompts of `context` random ids prefilled in chunks, then decode steps: the median wall time of steps
3-8 and, under torch's profiler, two more steps' device time split by kind (`profile_prefill.kernel_kind`) and
their top kernels. The same kinds on both backends say whether the distance is the attention kernel's or the
rest's. One JSON line per backend; profile_decode_rows.json under --out. `--device cpu` with a tiny checkpoint
checks the script itself (CPU op times then). `triton:plain-grid` in --attention: the triton backend with
its split kernel's work list off (`decode_work_list=False`, the default before session 30); `triton:work-list`
forces it on. Several backends run one process each (a second runner in one process ran out of memory)."""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from profile_prefill import kernel_times, profile_each  # noqa: E402  (a sibling script, not a package)


def _runner(args: argparse.Namespace, attention: str):
    from radixserve.config import Config
    from radixserve.model_runner import ModelRunner

    dummy = os.path.isdir(args.model) and not any(f.endswith(".safetensors") for f in os.listdir(args.model))
    cuda = args.device == "cuda"
    cfg = Config.build({
        "model": {"path": args.model, "load_format": "dummy" if dummy else "auto", "context_length": args.context + 64},
        "runtime": {"device": args.device, "dtype": "bfloat16" if cuda else "float32", "cuda_graph": False},
        "stack": {"attention": attention},
        "scheduler": {"max_running_requests": args.rows + 8, "max_total_tokens": args.rows * (args.context + 40)},
    })
    return ModelRunner(cfg, show_progress=False)


def profile_backend(args: argparse.Namespace, attention: str, vocab: int) -> dict:
    """One row; `attention` is a stack name, or `triton:work-list` for the triton backend with its split
    kernel's work list on (`decode_work_list`: one program per planned split instead of 32 a request)."""
    from radixserve.static_batch import StaticBatch

    name, _, variant = attention.partition(":")
    runner = _runner(args, name)
    if variant in ("work-list", "plain-grid"):
        runner.attn_backend.decode_work_list = variant == "work-list"
    elif variant:
        raise ValueError(f"unknown variant {variant!r} of {name} (known: work-list, plain-grid)")
    rng = random.Random(7)
    prompts = [[rng.randrange(100, vocab - 100) for _ in range(args.context)] for _ in range(args.rows)]
    chunk = max(1, args.chunk_tokens // args.rows)
    while args.context % chunk:  # every prompt must need the same number of chunks
        chunk -= 1
    batch = StaticBatch(runner, prompts, max_new_tokens=3 + 6 + 2 + 1, prefill_chunk=chunk)
    steps = batch.steps()
    next(steps)  # the prefill
    for _ in range(2):  # warm-up decode steps (first-use compiles), not timed
        next(steps)
    for _ in range(6):
        next(steps)
    timed = batch.result.decode_step_s[2:8]
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if args.device == "cuda" else [])
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(2):
            next(steps)
    for _ in steps:  # run to the end so the batch gives its slots back
        pass
    by_kind, top = kernel_times(prof, args.device, per=2)
    row = {
        "attention": attention, "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "rows": args.rows, "context": args.context, "prefill_chunk_per_prompt": chunk,
        "decode_step_ms_eager": round(statistics.median(timed) * 1e3, 3),
        "kernel_ms_per_step_by_kind": {k: round(v, 3) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
        "kernel_ms_per_step": round(sum(by_kind.values()), 3),
        "top_kernels_ms_per_step": [[round(ms, 3), name[:90]] for ms, name in sorted(top, reverse=True)[:14]],
    }
    del batch, steps, runner
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="benchmarks/model-configs/llama-3.1-8b")
    ap.add_argument("--rows", type=int, default=320)
    ap.add_argument("--context", type=int, default=1100, help="prompt length of every row")
    ap.add_argument("--chunk-tokens", type=int, default=16384, help="tokens per prefill forward, all rows together")
    ap.add_argument("--attention", default="triton,flashinfer")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    out_file = os.path.join(args.out, "profile_decode_rows.json")
    backends = args.attention.split(",")
    if len(backends) > 1:  # one process each: a second runner in the first's process ran out of memory (H100, s30)
        merged: dict = {}
        for attention in backends:
            with tempfile.TemporaryDirectory() as tmp:
                subprocess.run([sys.executable, __file__, *_without(sys.argv[1:], ("--attention", "--out")),
                                "--attention", attention, "--out", tmp], check=False)
                path = os.path.join(tmp, "profile_decode_rows.json")
                row = json.load(open(path)) if os.path.exists(path) else {attention: {"error": "the process failed"}}
            merged.update(row)
        with open(out_file, "w") as f:
            json.dump(merged, f, indent=1)
        return 0
    with open(os.path.join(args.model, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    profile_each(args.attention, lambda attention: profile_backend(args, attention, vocab), {}, out_file)
    return 0


def _without(argv: list[str], options: tuple[str, ...]) -> list[str]:
    """argv without the given options and their values (`--opt v` or `--opt=v`)."""
    kept, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in options:
            skip = True
        elif not a.startswith(tuple(o + "=" for o in options)):
            kept.append(a)
    return kept


if __name__ == "__main__":
    sys.exit(main())
