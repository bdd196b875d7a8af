"""Offline throughput of the Engine on random token ids: all requests submitted at once.

    python benchmarks/offline_throughput.py --model benchmarks/model-configs/llama-3.1-8b --load-format dummy \
        --tokenizer DIR --num-prompts 1000 --input-len 1024 --output-len 256 [section.key=value ...]

Prints one JSON line: requests, tokens, seconds, output and total (input+output) tok/s, and the
scheduler's own counters."""

from __future__ import annotations

import argparse
import time

from bench_env import emit
from radixserve.config import Config, deep_merge, parse_dotted_overrides


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--tokenizer")
    ap.add_argument("--num-prompts", type=int, default=1000)
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--vocab-high", type=int, default=30000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--result-file")
    ap.add_argument("overrides", nargs="*", metavar="section.key=value")
    args = ap.parse_args()
    import random

    from radixserve.engine import Engine

    model = {"path": args.model, "load_format": args.load_format, "context_length": args.input_len + args.output_len + 16}
    if args.tokenizer:
        model["tokenizer"] = args.tokenizer
    cfg = Config.build(deep_merge({"model": model}, parse_dotted_overrides(args.overrides)))
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(100, args.vocab_high) for _ in range(args.input_len)] for _ in range(args.num_prompts)]
    params = {"max_new_tokens": args.output_len, "ignore_eos": True, "temperature": 0.0}
    with Engine(config=cfg) as engine:
        # warm-up on prompts of their own: the timed ones must not find their prefix in the cache
        warm = [[rng.randrange(100, args.vocab_high) for _ in range(args.input_len)] for _ in range(4)]
        engine.generate(input_ids=warm, sampling_params={**params, "max_new_tokens": 4})
        engine.flush_cache()
        t0 = time.perf_counter()
        outs = engine.generate(input_ids=prompts, sampling_params=params)
        dt = time.perf_counter() - t0
        stats = engine.get_stats()
    n_out = sum(o["meta_info"]["completion_tokens"] for o in outs)
    n_in = sum(o["meta_info"]["prompt_tokens"] for o in outs)
    row = {
        "engine": "radixserve", "requests": len(outs), "input_tokens": n_in, "output_tokens": n_out,
        "seconds": round(dt, 2), "output_tok_s": round(n_out / dt, 1), "total_tok_s": round((n_in + n_out) / dt, 1),
        "stats": stats, "config": cfg.model_dump(),
    }
    emit(row, args.result_file)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
