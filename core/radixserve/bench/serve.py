"""`radixserve bench serve`: a load generator for any OpenAI-compatible server.

Sends streaming /v1/completions requests built from random token ids (`--dataset random`) or
from chat prompts (`--dataset chat`, via /v1/chat/completions), either as a Poisson process at
`--request-rate` or with at most `--max-concurrency` in flight, and reports request throughput,
input/output/total tok/s and TTFT / TPOT / ITL mean, p50 and p99."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass, field

from radixserve.config import api_key_or_env

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "List three prime numbers greater than 100.",
    "Translate 'good morning' into Spanish and German.",
    "Why is the sky blue?",
    "Give me a short recipe for pancakes.",
    "What does HTTP stand for?",
]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:30000", help="server root (without /v1)")
    p.add_argument("--model", default=None, help="model name to send (default: the server's first /v1/models entry)")
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY' (default: $RADIXSERVE_API_KEY if set)")
    p.add_argument("--dataset", choices=["random", "chat"], default="random")
    p.add_argument("--num-prompts", type=int, default=64, help="requests to send (default 64)")
    p.add_argument("--input-len", type=int, default=1024, help="random dataset: prompt tokens (default 1024; "
                   "64 x 1024 in / 128 out takes minutes on a small CPU)")
    p.add_argument("--output-len", type=int, default=128, help="tokens to generate per request (ignore_eos; default 128)")
    p.add_argument("--vocab-low", type=int, default=100, help="random ids are drawn from [vocab-low, vocab-high)")
    p.add_argument("--vocab-high", type=int, default=20000)
    p.add_argument("--request-rate", type=float, default=float("inf"), help="req/s (Poisson); inf, the default: all at once")
    p.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most (default: no limit)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout in seconds")
    p.add_argument("--result-file", help="append the summary as one JSON line")


class BenchError(Exception):
    """The benchmark cannot start (server unreachable, or it refuses to list its models);
    `run` prints it as one line and exits 2."""


@dataclass
class RequestRecord:
    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    start: float = 0.0
    ttft: float = 0.0
    latency: float = 0.0
    itls: list[float] = field(default_factory=list)


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = (len(s) - 1) * q / 100.0
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def _payloads(args: argparse.Namespace, model: str) -> list[tuple[str, dict]]:
    rng = random.Random(args.seed)
    out = []
    for i in range(args.num_prompts):
        common = {
            "model": model,
            "max_tokens": args.output_len,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            # usage on every chunk (a vLLM extension; servers without it just omit it): a chunk can
            # carry several tokens (a token that ends mid-character adds no text, so no event is sent)
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        }
        if args.dataset == "random":
            ids = [rng.randrange(args.vocab_low, args.vocab_high) for _ in range(args.input_len)]
            out.append(("/v1/completions", {**common, "prompt": ids}))
        else:
            msg = CHAT_PROMPTS[i % len(CHAT_PROMPTS)]
            out.append(("/v1/chat/completions", {**common, "messages": [{"role": "user", "content": msg}]}))
    return out


async def _one(client, path: str, payload: dict, rec: RequestRecord) -> None:
    rec.start = time.perf_counter()
    last = rec.start
    try:
        async with client.stream("POST", path, json=payload) as resp:
            if resp.status_code != 200:
                rec.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data.strip() == "[DONE]":
                    break
                chunk = json.loads(data)
                seen = rec.output_tokens
                if chunk.get("usage"):
                    rec.prompt_tokens = chunk["usage"].get("prompt_tokens", 0)
                    rec.output_tokens = chunk["usage"].get("completion_tokens", 0)
                if not chunk.get("choices"):
                    continue
                now = time.perf_counter()
                if rec.ttft == 0.0:
                    rec.ttft = now - rec.start
                else:
                    # a chunk of k tokens counts as k inter-token gaps of (its wait / k), as
                    # SGLang's bench_serving does; without per-chunk usage k is taken as 1
                    k = max(rec.output_tokens - seen, 1)
                    rec.itls.extend([(now - last) / k] * k)
                last = now
        rec.latency = time.perf_counter() - rec.start
        rec.ok = rec.ttft > 0
    except Exception as e:  # a failed request is counted and reported, never raised
        rec.error = repr(e)


async def run_benchmark(args: argparse.Namespace) -> dict:
    """Run the load and return the summary dict (what `run` prints)."""
    import httpx

    # the same default as `radixserve serve`, so one exported variable serves both
    api_key = api_key_or_env(args.api_key)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=args.base_url, headers=headers, timeout=args.timeout, limits=limits) as client:
        model = await _probe_model(client, args)
        work = _payloads(args, model)
        stats_before = await _server_stats(client)
        recs = [RequestRecord() for _ in work]
        sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
        rng = random.Random(args.seed + 1)

        done, every = 0, max(len(work) // 10, 1)
        print(f"radixserve bench serve: {len(work)} requests to {args.base_url} ({model})", file=sys.stderr)

        async def guarded(i: int) -> None:
            nonlocal done
            if sem is None:
                await _one(client, *work[i], recs[i])
            else:
                async with sem:
                    await _one(client, *work[i], recs[i])
            done += 1
            if done % every == 0 or done == len(work):  # a long run shows it is moving (docs audit 31)
                print(f"  {done}/{len(work)} done, {time.perf_counter() - t0:.1f} s", file=sys.stderr)

        t0 = time.perf_counter()
        tasks = []
        for i in range(len(work)):
            tasks.append(asyncio.create_task(guarded(i)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
        stats_after = await _server_stats(client)
    before, after = _spec_counters(stats_before), _spec_counters(stats_after)
    summary = summarize(recs, duration, args)
    summary["prompt_tokens_from_cache"] = _cache_share(_cache_counters(stats_before), _cache_counters(stats_after))
    if (summary["prompt_tokens_from_cache"] or 0) >= 0.5:
        print(f"radixserve bench serve: note: {summary['prompt_tokens_from_cache']:.0%} of the prompt tokens came from the "
              "server's prefix cache (a run with the same --seed before this one?): for cold prompts pass another "
              "--seed, or POST /flush_cache first", file=sys.stderr)
    summary["spec_verifies"] = None if before is None or after is None else after["spec_verifies"] - before["spec_verifies"]
    summary["spec_accept_length"] = _accept_length(before, after)
    return summary


async def _probe_model(client, args: argparse.Namespace) -> str:
    """GET /v1/models before any load: an unreachable server or a refused listing is one clear
    error, not a run of failed requests or a KeyError. With --model the listing's answer is
    not needed (some servers have none), so only the connection must succeed."""
    import httpx

    try:
        resp = await client.get("/v1/models")
    except httpx.TransportError as e:  # refused, unresolvable, timed out
        raise BenchError(f"cannot reach {args.base_url}: {str(e) or type(e).__name__}") from None
    if args.model is not None:
        return args.model
    if resp.status_code != 200:
        hint = " (pass --api-key, or set $RADIXSERVE_API_KEY)" if resp.status_code in (401, 403) else ""
        raise BenchError(f"GET /v1/models answered {resp.status_code}: {_error_message(resp)}{hint}")
    try:
        return resp.json()["data"][0]["id"]
    except (ValueError, KeyError, IndexError, TypeError):
        raise BenchError(f"GET /v1/models listed no model: {resp.text[:200]!r} (pass --model)") from None


def _error_message(resp) -> str:
    """The message of an OpenAI-shaped error body, else the body's start."""
    try:
        return str(resp.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return resp.text[:200].strip() or resp.reason_phrase


async def _server_stats(client) -> dict | None:
    """RadixServe's /server_info stats (the scheduler's counters), read once at each end of a run; None where the
    server has no such route or answer (not RadixServe)."""
    try:
        stats = (await client.get("/server_info")).json().get("stats")
    except Exception:
        return None
    return stats if isinstance(stats, dict) else None


def _spec_counters(stats: dict | None) -> dict | None:
    """The speculative counters of `stats`; None when the server does not speculate or does not report them."""
    if stats is None or not stats.get("speculative", True):
        return None
    try:
        return {k: stats[k] for k in ("spec_verifies", "spec_accepted_tokens")}
    except KeyError:
        return None


def _cache_counters(stats: dict | None) -> dict | None:
    """The prompt-token counters of `stats` (computed, and served from the prefix cache); None where not reported."""
    try:
        return {k: int(stats[k]) for k in ("prefill_tokens_cached", "prefill_tokens_computed")}
    except (TypeError, KeyError, ValueError):
        return None


def _cache_share(before: dict | None, after: dict | None) -> float | None:
    """The share of the run's prompt tokens the server took from its prefix cache (None: not reported)."""
    if before is None or after is None:
        return None
    cached = after["prefill_tokens_cached"] - before["prefill_tokens_cached"]
    total = cached + after["prefill_tokens_computed"] - before["prefill_tokens_computed"]
    return round(cached / total, 3) if total > 0 else 0.0


def _accept_length(before: dict | None, after: dict | None) -> float | None:
    """Mean tokens per verify over the run (accepted drafts + the target's own token); 0.0 when
    the server speculated but verified no draft (the run's spec_verifies is 0: as the server's own
    spec_accept_length); None when the server does not speculate or does not report it."""
    if before is None or after is None:
        return None
    verifies = after["spec_verifies"] - before["spec_verifies"]
    if verifies <= 0:
        return 0.0
    return round((after["spec_accepted_tokens"] - before["spec_accepted_tokens"] + verifies) / verifies, 3)


def summarize(recs: list[RequestRecord], duration: float, args: argparse.Namespace) -> dict:
    ok = [r for r in recs if r.ok]
    itls = [x for r in ok for x in r.itls]
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    inp = sum(r.prompt_tokens for r in ok)
    outp = sum(r.output_tokens for r in ok)
    ms = lambda xs, q: round(percentile(xs, q) * 1e3, 2)  # noqa: E731
    return {
        "completed": len(ok),
        "failed": len(recs) - len(ok),
        "errors": sorted({r.error for r in recs if r.error})[:5],
        "duration_s": round(duration, 3),
        "request_throughput": round(len(ok) / duration, 3),
        "input_tok_s": round(inp / duration, 1),
        "output_tok_s": round(outp / duration, 1),
        "total_tok_s": round((inp + outp) / duration, 1),
        "ttft_ms": {"mean": round(sum(r.ttft for r in ok) / max(len(ok), 1) * 1e3, 2), "p50": ms([r.ttft for r in ok], 50), "p99": ms([r.ttft for r in ok], 99)},
        "tpot_ms": {"mean": round(sum(tpots) / max(len(tpots), 1) * 1e3, 2), "p50": ms(tpots, 50), "p99": ms(tpots, 99)},
        "itl_ms": {"mean": round(sum(itls) / max(len(itls), 1) * 1e3, 2), "p50": ms(itls, 50), "p99": ms(itls, 99)},
        "itl_samples": len(itls),  # one per output token after the first when the server reports usage per chunk
        "config": {
            "dataset": args.dataset,
            "num_prompts": args.num_prompts,
            "input_len": args.input_len if args.dataset == "random" else None,
            "output_len": args.output_len,
            "request_rate": None if args.request_rate == float("inf") else args.request_rate,  # null: all at once
            "max_concurrency": args.max_concurrency,
        },
    }


def run(args: argparse.Namespace) -> int:
    try:
        summary = asyncio.run(run_benchmark(args))
    except BenchError as e:
        print(f"radixserve bench serve: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(summary, indent=2))
    if args.result_file:
        with open(args.result_file, "a") as f:
            f.write(json.dumps(summary) + "\n")
    return 0 if summary["failed"] == 0 else 1
