"""Data-parallel router on the CPU: prefix-cache hit rate and throughput per routing policy.

For each policy, starts `radixserve serve --dp 2 --router-policy POLICY` (SmolLM2-135M, one CPU
thread per replica), flushes the caches, and sends a shared-prefix workload: GROUPS long
"documents" each followed by QUESTIONS short questions, in a seeded random order, CONCURRENCY
requests at a time. The hit rate is the replicas' own: prompt tokens served from their radix
caches over all prompt tokens they prefilled (the deltas of prefill_tokens_cached /
prefill_tokens_computed in the router's aggregated /server_info). Optionally the same workload
against one plain server (`--single`, 2 threads) as a reference for throughput.

    .venv/bin/python benchmarks/dp_router_cpu.py --out /tmp/dp-router.jsonl
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import socket
import subprocess
import sys
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_env import commit, emit, machine  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def workload(groups: int, questions: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    words = "river stone lamp garden copper window violin harbor meadow pencil glacier orchard".split()
    docs = [f"Document {g}. " + " ".join(rng.choice(words) for _ in range(220)) for g in range(groups)]
    prompts = [
        f"{docs[g]}\nQuestion {q}: which word appears most often?" for g in range(groups) for q in range(questions)
    ]
    rng.shuffle(prompts)
    return prompts


def start(dp: int, policy: str | None, log_path: str) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    cmd = [sys.executable, "-m", "radixserve.cli", "serve", "--port", str(port)]
    if dp > 1:
        cmd += ["--dp", str(dp), "--router-policy", policy, "runtime.num_threads=1"]
    else:
        cmd += ["runtime.num_threads=2"]
    cmd += ["server.log_requests=false", "scheduler.cpu_kv_cache_gb=0.5"]  # overrides last (positional)
    proc = subprocess.Popen(cmd, stdout=open(log_path, "w"), stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 900
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}; see {log_path}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"server not healthy; see {log_path}")
        time.sleep(0.5)


async def drive(url: str, model: str, prompts: list[str], concurrency: int, max_tokens: int) -> dict:
    sem = asyncio.Semaphore(concurrency)
    out_tokens = 0
    latencies: list[float] = []

    async with httpx.AsyncClient(timeout=600) as client:

        async def one(prompt: str) -> None:
            nonlocal out_tokens
            async with sem:
                t0 = time.perf_counter()
                body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                        "ignore_eos": True}  # fmt: skip
                r = await client.post(f"{url}/v1/completions", json=body)
                r.raise_for_status()
                latencies.append(time.perf_counter() - t0)
                out_tokens += r.json()["usage"]["completion_tokens"]

        t0 = time.perf_counter()
        await asyncio.gather(*(one(p) for p in prompts))
        wall = time.perf_counter() - t0
    latencies.sort()
    return {
        "wall_s": round(wall, 2),
        "requests_per_s": round(len(prompts) / wall, 3),
        "output_tok_per_s": round(out_tokens / wall, 1),
        "latency_p50_s": round(latencies[len(latencies) // 2], 3),
    }


def measure(dp: int, policy: str | None, args: argparse.Namespace) -> dict:
    log_path = f"/tmp/dp-router-bench-{policy or 'single'}.log"
    proc, url = start(dp, policy, log_path)
    try:
        model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
        prompts = workload(args.groups, args.questions)
        asyncio.run(drive(url, model, prompts[: args.concurrency], args.concurrency, 2))  # warm-up
        httpx.post(f"{url}/flush_cache", timeout=60).raise_for_status()
        before = httpx.get(f"{url}/server_info", timeout=60).json()["stats"]
        row = asyncio.run(drive(url, model, prompts, args.concurrency, args.max_tokens))
        info = httpx.get(f"{url}/server_info", timeout=60).json()
        after = info["stats"]
        cached = after["prefill_tokens_cached"] - before["prefill_tokens_cached"]
        computed = after["prefill_tokens_computed"] - before["prefill_tokens_computed"]
        per_replica = [
            r["stats"]["finished_requests"] for r in info.get("replicas", []) if isinstance(r.get("stats"), dict)
        ]
        return {
            "config": f"dp={dp} {policy}" if dp > 1 else "single server (2 threads)",
            "requests": len(prompts),
            "cache_hit_rate": round(cached / (cached + computed), 4),
            "prefill_tokens_computed": computed,
            "prefill_tokens_cached": cached,
            "finished_per_replica_since_start": per_replica,
            **row,
        }
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(120)
        if code != 0:
            print(f"warning: server exited with {code}; see {log_path}", file=sys.stderr)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--questions", type=int, default=6)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--policies", default="cache_aware,round_robin,least_load")
    ap.add_argument("--single", action="store_true", help="also run one plain server with 2 threads")
    ap.add_argument("--out", help="append JSON lines here")
    args = ap.parse_args()
    emit({"machine": machine(), "commit": commit(), "args": vars(args)}, args.out)
    for policy in args.policies.split(","):
        emit(measure(2, policy, args), args.out)
    if args.single:
        emit(measure(1, None, args), args.out)


if __name__ == "__main__":
    main()
