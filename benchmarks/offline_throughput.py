"""Offline throughput of the Engine on random token ids: all requests submitted at once.

    python benchmarks/offline_throughput.py --model benchmarks/model-configs/llama-3.1-8b --load-format dummy \
        --tokenizer DIR --num-prompts 1000 --input-len 1024 --output-len 256 [section.key=value ...]

Prints one JSON line: requests, tokens, seconds, output and total (input+output) tok/s, and the
scheduler's own counters.

What the figures mean:
- `output_tok_s` = output tokens / `seconds`, the wall time of one `Engine.generate` over all prompts:
  it includes each prompt's prefill (e.g. 1024 tokens), the first token and the last step's
  hand-back, so at batch 1 it is an end-to-end request rate, below the decode speed. Unchanged
  meaning since the first sessions: compare it with earlier results.
- `decode` (`--decode-timing`, default on up to 8 prompts): a second pass on fresh prompts of the same
  lengths, streamed (`async_generate(stream=True)`), timing each token's arrival on the host: per
  request decode tok/s = (output tokens - 1) / (time of its last token - time of its first token),
  the "eval tok/s" of llama.cpp and the inverse of vLLM's mean inter-token latency. `decode_tok_s`
  sums the per-request rates (at batch 1: the request's rate), `ttft_s` is the mean time to the first
  token, and `stream_output_tok_s` is `output_tok_s`'s definition on the streamed pass (how much the
  streaming itself costs). The decode pass runs after the timed one: `output_tok_s` is unaffected."""

from __future__ import annotations

import argparse
import asyncio
import time

from bench_env import emit
from radixserve.config import Config, deep_merge, parse_dotted_overrides


async def streamed_decode(engine, prompts: list[list[int]], params: dict) -> dict:
    """All prompts at once, streamed: each request's token arrival times on the host -> the
    decode-only figures (module docstring)."""

    async def one(ids: list[int]) -> tuple[float, float, int]:
        first = last = None
        n = 0
        async for out in await engine.async_generate(input_ids=ids, sampling_params=params, stream=True):
            now = time.perf_counter()
            got = len(out["output_ids"])
            if got > n:
                first = now if first is None else first
                last, n = now, got
        return first, last, n

    t0 = time.perf_counter()
    rows = await asyncio.gather(*(one(p) for p in prompts))
    dt = time.perf_counter() - t0
    rates = [(n - 1) / (last - first) for first, last, n in rows if n > 1 and last > first]
    n_out = sum(n for _, _, n in rows)
    return {
        "decode_tok_s": round(sum(rates), 1),
        "decode_tok_s_per_request": round(sum(rates) / len(rates), 1) if rates else None,
        "ms_per_token": round(1e3 * len(rates) / sum(rates), 3) if rates else None,
        "ttft_s": round(sum(first for first, _, _ in rows) / len(rows) - t0, 4),
        "stream_seconds": round(dt, 2), "stream_output_tokens": n_out, "stream_output_tok_s": round(n_out / dt, 1),
    }


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
    ap.add_argument("--decode-timing", choices=("auto", "on", "off"), default="auto",
                    help="also time decode alone on a streamed second pass (auto: on for up to 8 prompts)")
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
        decode = None
        if args.decode_timing == "on" or (args.decode_timing == "auto" and args.num_prompts <= 8):
            engine.flush_cache()
            fresh = [[rng.randrange(100, args.vocab_high) for _ in range(args.input_len)] for _ in prompts]
            decode = asyncio.run(streamed_decode(engine, fresh, params))
    n_out = sum(o["meta_info"]["completion_tokens"] for o in outs)
    n_in = sum(o["meta_info"]["prompt_tokens"] for o in outs)
    row = {
        "engine": "radixserve", "requests": len(outs), "input_tokens": n_in, "output_tokens": n_out,
        "seconds": round(dt, 2), "output_tok_s": round(n_out / dt, 1), "total_tok_s": round((n_in + n_out) / dt, 1),
        "stats": stats, "config": cfg.model_dump(),
    }
    if decode is not None:
        row["decode"] = decode
    emit(row, args.result_file)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
