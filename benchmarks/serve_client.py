"""Load client for a RadixServe (or any OpenAI-compatible) server: 64 streaming chat requests at
concurrency 16 by default; reports output tok/s, TTFT, TPOT and ITL (mean / p50 / p99).

The measuring itself is `radixserve bench serve` (radixserve.bench.serve); this script adds the
defaults of the CPU serving benchmark, can launch the server for the run (--launch), and can append
the result with machine, commit and command to a markdown file (--markdown).

    python benchmarks/serve_client.py --launch                       # embedded SmolLM2, port 30000
    python benchmarks/serve_client.py --base-url http://127.0.0.1:30000 --markdown benchmarks/results/cpu-serve.md
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from urllib.parse import urlparse

from bench_env import commit, machine
from radixserve.bench import serve as bench


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bench.add_arguments(p)
    p.set_defaults(dataset="chat", num_prompts=64, max_concurrency=16, output_len=64)
    p.add_argument("--launch", action="store_true", help="start `radixserve serve` for the run, stop it after")
    p.add_argument("--serve-args", default="", help="extra arguments for the launched server (one string)")
    p.add_argument("--markdown", metavar="FILE", help="append the result as a markdown section")
    return p.parse_args(argv)


def _healthy(base_url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{base_url}/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def launch(args: argparse.Namespace) -> subprocess.Popen:
    port = urlparse(args.base_url).port or 30000
    cmd = [sys.executable, "-m", "radixserve.cli", "serve", "--port", str(port), *shlex.split(args.serve_args)]
    if args.api_key:
        cmd += ["--api-key", args.api_key]
    proc = subprocess.Popen(cmd)
    deadline = time.time() + 600
    while not _healthy(args.base_url):
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            raise SystemExit(f"the server did not come up (exit code {proc.poll()})")
        time.sleep(0.5)
    return proc


def to_markdown(summary: dict, command: str) -> str:
    t, i, tp = summary["ttft_ms"], summary["itl_ms"], summary["tpot_ms"]
    c = summary["config"]
    return "\n".join(
        [
            f"## {time.strftime('%Y-%m-%d %H:%M')} — {c['num_prompts']} requests, concurrency {c['max_concurrency']}",
            "",
            f"- machine: {machine()}",
            f"- commit: {commit()}",
            f"- command: `{command}`",
            "",
            "| completed | failed | duration s | req/s | output tok/s | TTFT p50 / p99 ms | ITL p50 / p99 ms | TPOT p50 ms |",
            "|---|---|---|---|---|---|---|---|",
            f"| {summary['completed']} | {summary['failed']} | {summary['duration_s']} | {summary['request_throughput']} "
            f"| {summary['output_tok_s']} | {t['p50']} / {t['p99']} | {i['p50']} / {i['p99']} | {tp['p50']} |",
            "",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # SIGTERM (e.g. from `timeout`) must still stop a launched server: run the finally below
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    server = launch(args) if args.launch else None
    try:
        summary = asyncio.run(bench.run_benchmark(args))
    finally:
        if server is not None:
            server.terminate()
            server.wait(30)
    print(json.dumps(summary, indent=2))
    if args.markdown:
        command = "python benchmarks/serve_client.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
        with open(args.markdown, "a") as f:
            f.write(to_markdown(summary, command) + "\n")
    return 0 if summary["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
