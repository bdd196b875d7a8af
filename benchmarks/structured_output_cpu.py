"""Structured output on the CPU with SmolLM2: validity on a schema corpus, batch-16 overhead, and
time to first token with an uncached grammar.

1. Validity: every schema of the corpus (default benchmarks/data/real_json_schemas.jsonl: 264
   real-world schemas from JSONSchemaBench, see benchmarks/data/README.md) as
   `response_format: json_schema` on /v1/chat/completions (greedy). Each output is parsed and
   validated with `jsonschema`; counted: valid, invalid (and why), cut by max_tokens, refused by
   the server (400, with the reason), server errors (5xx / connection failures).
2. Overhead: 16 concurrent chat requests, every one with a JSON-schema constraint, against the
   same 16 without one (both `ignore_eos` to the same max_tokens, so both make the same number of
   tokens); output tokens per second of each, and the ratio. The two kinds alternate, round after
   round (--rounds), and the medians are compared: on a shared machine, contention then hits both
   alike.
3. TTFT: streaming requests one at a time, unconstrained vs constrained by a schema never seen
   before (a fresh property name each time, so its grammar is compiled inside the measured time).

    python benchmarks/structured_output_cpu.py --launch                   # everything, embedded SmolLM2
    python benchmarks/structured_output_cpu.py --launch --limit 5 --trials 2   # a smoke run
    python benchmarks/structured_output_cpu.py --base-url http://127.0.0.1:30000 --out results.json

Writes a JSON summary to --out (default: $OUT/structured_output_cpu.json when $OUT is set, else
benchmarks/results/structured_output_cpu.json) and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import jsonschema

HERE = Path(__file__).parent
CORPUS = HERE / "data" / "real_json_schemas.jsonl"
TIMEOUT = 900


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:30000")
    p.add_argument("--launch", action="store_true", help="start `radixserve serve` for the run, stop it after")
    p.add_argument("--serve-args", default="", help="extra arguments for the launched server (one string)")
    p.add_argument("--corpus", type=Path, default=CORPUS, help="JSONL of {id, prompt, schema, features}")
    p.add_argument("--limit", type=int, default=0, help="only the first N schemas of the corpus (0: all)")
    p.add_argument("--schemas", default="", help="validity run: only these corpus ids (comma list), or @FILE of a "
                   "results JSON: its `not_valid` ids that were invalid or timed out (server_error)")
    p.add_argument("--concurrency", type=int, default=8, help="validity run: requests in flight")
    p.add_argument("--max-tokens", type=int, default=1024, help="validity run: token budget per output")
    p.add_argument("--validity-params", type=json.loads, default={},
                   help='validity run: extra request fields as JSON, e.g. \'{"repetition_penalty": 1.1}\' '
                        "(greedy SmolLM2 otherwise loops inside what some schemas allow until max_tokens)")
    p.add_argument("--batch", type=int, default=16, help="overhead run: concurrent requests")
    p.add_argument("--batch-tokens", type=int, default=64, help="overhead run: tokens per request")
    p.add_argument("--rounds", type=int, default=5, help="overhead run: rounds of each kind, alternating")
    p.add_argument("--trials", type=int, default=5, help="TTFT run: requests of each kind")
    p.add_argument("--skip", default="", help="comma list of parts to skip: validity,overhead,ttft")
    p.add_argument("--timeout", type=float, default=TIMEOUT, help="client read timeout per request, seconds")
    p.add_argument("--out", default=None)
    return p.parse_args()


def launch(base_url: str, serve_args: str) -> subprocess.Popen:
    port = httpx.URL(base_url).port or 30000
    cmd = [sys.executable, "-m", "radixserve.cli", "serve", "--port", str(port), *shlex.split(serve_args)]
    proc = subprocess.Popen(cmd)
    deadline = time.time() + 600
    while True:
        try:
            if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            raise SystemExit(f"the server did not come up (exit code {proc.poll()})")
        time.sleep(0.5)


def chat(client: httpx.Client, model: str, prompt: str, **extra) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "temperature": 0, **extra}
    return client.post("/v1/chat/completions", json=body, timeout=TIMEOUT)


def response_format(schema: dict, name: str = "payload") -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


# ---- 1. validity ----------------------------------------------------------------------------------


def one_schema(client: httpx.Client, model: str, entry: dict, max_tokens: int, params: dict) -> dict:
    rec = {"id": entry["id"], "features": entry["features"]}
    try:
        r = chat(client, model, entry["prompt"], max_tokens=max_tokens, response_format=response_format(entry["schema"]),
                 **params)
    except httpx.HTTPError as e:
        return {**rec, "outcome": "server_error", "detail": repr(e)}
    if r.status_code == 400:
        return {**rec, "outcome": "refused", "detail": r.json()["error"]["message"]}
    if r.status_code != 200:
        return {**rec, "outcome": "server_error", "detail": f"HTTP {r.status_code}: {r.text[:300]}"}
    choice = r.json()["choices"][0]
    text = choice["message"]["content"]
    rec["completion_tokens"] = r.json()["usage"]["completion_tokens"]
    if choice["finish_reason"] == "length":
        return {**rec, "outcome": "cut_by_max_tokens", "detail": text[-120:]}
    try:
        jsonschema.validate(json.loads(text), entry["schema"])
    except (ValueError, jsonschema.ValidationError) as e:
        return {**rec, "outcome": "invalid", "detail": f"{str(e)[:300]} | output: {text[:300]}"}
    return {**rec, "outcome": "valid"}


def selected_ids(spec: str) -> set[str]:
    if spec.startswith("@"):
        previous = json.loads(Path(spec[1:]).read_text())["validity"]["not_valid"]
        return {r["id"] for r in previous if r["outcome"] in ("invalid", "server_error")}
    return {s.strip() for s in spec.split(",") if s.strip()}


def validity(client: httpx.Client, model: str, args: argparse.Namespace) -> dict:
    entries = [json.loads(line) for line in args.corpus.read_text().splitlines() if line.strip()]
    if args.schemas:
        wanted = selected_ids(args.schemas)
        entries = [e for e in entries if e["id"] in wanted]
    if args.limit:
        entries = entries[: args.limit]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(args.concurrency) as pool:
        records = list(pool.map(lambda e: one_schema(client, model, e, args.max_tokens, args.validity_params), entries))
    counts: dict[str, int] = {}
    for rec in records:
        counts[rec["outcome"]] = counts.get(rec["outcome"], 0) + 1
    accepted = len(records) - counts.get("refused", 0)
    return {
        "corpus": str(args.corpus),
        "max_tokens": args.max_tokens,
        "request_params": args.validity_params,
        "schemas": len(records),
        "counts": counts,
        "valid_pct_of_accepted": round(100.0 * counts.get("valid", 0) / max(accepted, 1), 2),
        "duration_s": round(time.perf_counter() - t0, 1),
        "not_valid": [r for r in records if r["outcome"] != "valid"],
    }


# ---- 2. batch overhead ----------------------------------------------------------------------------

LONG_SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "paragraphs": {"type": "array", "items": {"type": "string"}, "minItems": 20},
    },
    "required": ["title", "paragraphs"],
}


def batch_tok_s(client: httpx.Client, model: str, args: argparse.Namespace, constrained: bool) -> dict:
    extra = {"max_tokens": args.batch_tokens, "ignore_eos": True}
    if constrained:
        extra["response_format"] = response_format(LONG_SCHEMA, "story")
    prompts = [f"Write a short story number {i} about a lighthouse, as JSON." for i in range(args.batch)]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(args.batch) as pool:
        rs = list(pool.map(lambda p: chat(client, model, p, **extra), prompts))
    dt = time.perf_counter() - t0
    bad = [r.text[:200] for r in rs if r.status_code != 200]
    if bad:
        raise SystemExit(f"overhead run failed: {bad[0]}")
    tokens = sum(r.json()["usage"]["completion_tokens"] for r in rs)
    return {"requests": len(rs), "completion_tokens": tokens, "duration_s": round(dt, 2), "tok_s": round(tokens / dt, 1)}


def overhead(client: httpx.Client, model: str, args: argparse.Namespace) -> dict:
    batch_tok_s(client, model, args, True)  # warm: the backend (vocabulary index) and this grammar
    batch_tok_s(client, model, args, False)
    plain, constrained = [], []
    for i in range(args.rounds):  # alternate (and swap who goes first) so drift hits both kinds
        for kind in ((False, True) if i % 2 == 0 else (True, False)):
            (constrained if kind else plain).append(batch_tok_s(client, model, args, kind))
    p50p = statistics.median(r["tok_s"] for r in plain)
    p50c = statistics.median(r["tok_s"] for r in constrained)
    return {"rounds": args.rounds, "unconstrained_tok_s": [r["tok_s"] for r in plain],
            "constrained_tok_s": [r["tok_s"] for r in constrained], "median_unconstrained_tok_s": p50p,
            "median_constrained_tok_s": p50c, "completion_tokens_per_round": plain[0]["completion_tokens"],
            "constrained_over_unconstrained": round(p50c / p50p, 3)}


# ---- 3. TTFT with an uncached grammar -------------------------------------------------------------


def ttft_ms(client: httpx.Client, model: str, extra: dict) -> float:
    body = {"model": model, "messages": [{"role": "user", "content": "Describe a cat as JSON."}], "temperature": 0,
            "max_tokens": 4, "stream": True, **extra}
    t0 = time.perf_counter()
    with client.stream("POST", "/v1/chat/completions", json=body, timeout=TIMEOUT) as r:
        if r.status_code != 200:
            raise SystemExit(f"TTFT request failed: HTTP {r.status_code} {r.read()[:200]!r}")
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                delta = json.loads(line[6:])["choices"]
                if delta and delta[0]["delta"].get("content"):
                    return 1000 * (time.perf_counter() - t0)
    raise SystemExit("TTFT request streamed no content")


def fresh_schema() -> dict:
    key = f"field_{uuid.uuid4().hex[:8]}"  # never seen: its grammar is compiled within the request
    return {"type": "object", "properties": {key: {"type": "string"}, "legs": {"type": "integer"}},
            "required": [key, "legs"]}


def ttft(client: httpx.Client, model: str, args: argparse.Namespace) -> dict:
    ttft_ms(client, model, {"response_format": response_format(fresh_schema())})  # warm the backend itself
    plain, constrained = [], []
    for _ in range(args.trials):
        plain.append(ttft_ms(client, model, {}))
        constrained.append(ttft_ms(client, model, {"response_format": response_format(fresh_schema())}))
    p50p, p50c = statistics.median(plain), statistics.median(constrained)
    return {"trials": args.trials, "unconstrained_ms": [round(x, 1) for x in plain],
            "uncached_grammar_ms": [round(x, 1) for x in constrained], "median_unconstrained_ms": round(p50p, 1),
            "median_uncached_grammar_ms": round(p50c, 1), "median_difference_ms": round(p50c - p50p, 1)}


def main() -> None:
    global TIMEOUT
    args = parse_args()
    TIMEOUT = args.timeout
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    proc = launch(args.base_url, args.serve_args) if args.launch else None
    try:
        with httpx.Client(base_url=args.base_url) as client:
            model = client.get("/v1/models").json()["data"][0]["id"]
            summary: dict = {"model": model, "command": " ".join(map(shlex.quote, sys.argv)), "time": time.strftime("%Y-%m-%d %H:%M")}
            if "validity" not in skip:
                summary["validity"] = validity(client, model, args)
            if "overhead" not in skip:
                summary["overhead"] = overhead(client, model, args)
            if "ttft" not in skip:
                summary["ttft"] = ttft(client, model, args)
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
    out = Path(args.out or (Path(os.environ["OUT"]) if os.environ.get("OUT") else HERE / "results") / "structured_output_cpu.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: v for k, v in summary.items() if k != "validity"}, indent=1))
    if "validity" in summary:
        v = summary["validity"]
        print(f"validity: {v['counts']} -> {v['valid_pct_of_accepted']}% of accepted schemas valid ({v['schemas']} schemas)")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
