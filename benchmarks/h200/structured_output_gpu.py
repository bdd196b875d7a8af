"""Structured output on the H200: batch-64 decode tok/s with a JSON-schema constraint on every
request vs none (target: within 5%), and the validity of bounded constrained outputs.

The model is the Llama-3.1-8B shape with dummy bf16 weights, so outputs are random tokens: the
grammar alone makes them valid. The tokenizer is synthetic (`--make-tokenizer DIR`): byte-level,
one token per id of the model's 128,256 (the 256 bytes, then printable strings of 2-4 characters),
so the grammar backend indexes a vocabulary as large as Llama-3's and every sampled id decodes.

1. Throughput: 64 concurrent /generate requests (random 128-token prompts, ignore_eos, greedy,
   max_new_tokens 256) in rounds, constrained by a schema whose documents are longer than 256
   tokens (an array of at least 400 small objects: the grammar never ends a request early, so
   both kinds make exactly 64 x 256 tokens), alternating with the same requests unconstrained;
   medians of the rounds' output tok/s; from the server's stats, how many of the constrained
   rounds' decode batches were launched ahead (overlap scheduling, on by default on CUDA).
2. TTFT: one request at a time, a 1-token /generate unconstrained vs with a schema never seen
   before (compiled inside the measured time): medians (target: within 50 ms).
3. Validity: 64 requests with schemas whose documents are bounded (enums, bounded integers,
   maxLength strings, maxItems arrays, nesting, anyOf), max_new_tokens large enough for the
   longest document: each output must parse and validate (jsonschema when installed, else parsed
   and checked by hand for the fields).

    python benchmarks/h200/structured_output_gpu.py --make-tokenizer /tmp/tok128k
    python benchmarks/h200/structured_output_gpu.py --base-url http://127.0.0.1:30200 --out $OUT
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from full_vocab_tokenizer import make_tokenizer

VOCAB = 128256

THROUGHPUT_SCHEMA = {
    "type": "array", "minItems": 400,
    "items": {"type": "object", "properties": {"id": {"type": "integer"}, "ok": {"type": "boolean"},
                                               "tag": {"enum": ["red", "green", "blue"]}},
              "required": ["id", "ok", "tag"], "additionalProperties": False},
}

BOUNDED_SCHEMAS = [
    {"type": "object", "properties": {"status": {"enum": ["open", "closed", "pending"]}, "count": {"type": "integer", "minimum": 0, "maximum": 999}},
     "required": ["status", "count"], "additionalProperties": False},
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 4}},
     "required": ["name", "tags"], "additionalProperties": False},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": -50, "maximum": 50}, "y": {"type": "integer", "minimum": -50, "maximum": 50}},
                                                "required": ["x", "y"], "additionalProperties": False},
                                      "label": {"anyOf": [{"type": "boolean"}, {"enum": ["none"]}]}},
     "required": ["point", "label"], "additionalProperties": False},
    {"type": "object", "properties": {"items": {"type": "array", "minItems": 1, "maxItems": 3,
                                                "items": {"type": "object", "properties": {"sku": {"type": "string", "maxLength": 8}, "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
                                                          "required": ["sku", "qty"], "additionalProperties": False}}},
     "required": ["items"], "additionalProperties": False},
]


def generate(client, ids: list[int], **sp) -> dict:
    r = client.post("/generate", json={"input_ids": ids, "sampling_params": {"temperature": 0, **sp}}, timeout=600)
    if r.status_code != 200:
        raise SystemExit(f"/generate failed: HTTP {r.status_code} {r.text[:300]}")
    return r.json()


def scheduler_stats(client) -> dict:
    return client.get("/server_info", timeout=60).json().get("stats", {})


def one_round(client, prompts: list[list[int]], constrained: bool, max_new: int) -> dict:
    sp = {"max_new_tokens": max_new, "ignore_eos": True}
    if constrained:
        sp["json_schema"] = json.dumps(THROUGHPUT_SCHEMA)
    before = scheduler_stats(client)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as pool:
        outs = list(pool.map(lambda p: generate(client, p, **sp), prompts))
    dt = time.perf_counter() - t0
    after = scheduler_stats(client)
    tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
    # decode batches launched ahead (overlap scheduling) out of all decode batches of the round
    decodes = after.get("decode_batches", 0) - before.get("decode_batches", 0)
    ahead = after.get("overlapped_batches", 0) - before.get("overlapped_batches", 0)
    # the scheduler's own time per step over the round (its step() calls; prefill steps included)
    steps = after.get("steps", 0) - before.get("steps", 0)
    step_ms = 1000 * (after.get("step_seconds", 0) - before.get("step_seconds", 0)) / max(steps, 1)
    return {"tok_s": round(tokens / dt, 1), "tokens": tokens, "s": round(dt, 3), "decode_batches": decodes,
            "launched_ahead": ahead, "steps": steps, "step_ms": round(step_ms, 3),
            "prefill_batches": after.get("prefill_batches", 0) - before.get("prefill_batches", 0)}


def throughput(client, args) -> dict:
    rng = random.Random(0)
    prompts = [[rng.randrange(300, 30000) for _ in range(args.input_len)] for _ in range(args.batch)]
    one_round(client, prompts, True, 16)  # warm: the backend's vocabulary index, the grammar, graphs
    one_round(client, prompts, False, 16)
    plain, constrained = [], []
    for i in range(args.rounds):  # alternating, who goes first swapped each round
        for kind in ((False, True) if i % 2 == 0 else (True, False)):
            (constrained if kind else plain).append(one_round(client, prompts, kind, args.max_new))
        print(f"round {i + 1}/{args.rounds}: unconstrained {plain[-1]['tok_s']} tok/s, constrained "
              f"{constrained[-1]['tok_s']} tok/s ({constrained[-1]['launched_ahead']}/{constrained[-1]['decode_batches']} "
              f"constrained decode batches launched ahead); scheduler ms/step {plain[-1]['step_ms']} vs "
              f"{constrained[-1]['step_ms']} over {plain[-1]['steps']} vs {constrained[-1]['steps']} steps", flush=True)
    p, c = statistics.median(r["tok_s"] for r in plain), statistics.median(r["tok_s"] for r in constrained)
    return {"batch": args.batch, "max_new_tokens": args.max_new, "rounds": args.rounds,
            "unconstrained": plain, "constrained": constrained, "median_unconstrained_tok_s": p,
            "median_constrained_tok_s": c, "constrained_over_unconstrained": round(c / p, 4)}


def first_token(client, args) -> dict:
    """Time to first token, one request at a time: a 1-token /generate (its latency is the
    prefill and the first sampled token) unconstrained vs with a schema never seen before (a fresh
    property name each time, so its grammar is compiled inside the measured time)."""
    rng = random.Random(2)
    ids = [rng.randrange(300, 30000) for _ in range(args.input_len)]

    def timed(**sp) -> float:
        t0 = time.perf_counter()
        generate(client, ids, max_new_tokens=1, **sp)
        return 1000 * (time.perf_counter() - t0)

    def fresh() -> str:
        return json.dumps({"type": "object", "properties": {f"f{rng.getrandbits(40):x}": {"type": "string"},
                                                            "n": {"type": "integer"}}, "required": ["n"]})

    timed()
    timed(json_schema=fresh())
    plain, uncached = [], []
    for _ in range(args.trials):
        plain.append(timed())
        uncached.append(timed(json_schema=fresh()))
    p, u = statistics.median(plain), statistics.median(uncached)
    return {"trials": args.trials, "unconstrained_ms": [round(x, 1) for x in plain],
            "uncached_grammar_ms": [round(x, 1) for x in uncached], "median_unconstrained_ms": round(p, 1),
            "median_uncached_grammar_ms": round(u, 1), "median_difference_ms": round(u - p, 1)}


def validity(client, args) -> dict:
    try:
        import jsonschema
    except ImportError:
        jsonschema = None
    rng = random.Random(1)
    jobs = [(BOUNDED_SCHEMAS[i % len(BOUNDED_SCHEMAS)], [rng.randrange(300, 30000) for _ in range(32)]) for i in range(args.batch)]

    def run(job):
        schema, ids = job
        out = generate(client, ids, max_new_tokens=400, json_schema=json.dumps(schema))
        try:
            value = json.loads(out["text"])
            if jsonschema is not None:
                jsonschema.validate(value, schema)
            elif set(value) != set(schema["required"]):
                raise ValueError(f"fields {sorted(value)}")
        except Exception as e:
            return {"ok": False, "why": str(e)[:200], "text": out["text"][:200], "finish": out["meta_info"]["finish_reason"]}
        return {"ok": True}

    with ThreadPoolExecutor(args.batch) as pool:
        recs = list(pool.map(run, jobs))
    return {"requests": len(recs), "valid": sum(r["ok"] for r in recs), "checked_with": "jsonschema" if jsonschema else "json + fields",
            "failures": [r for r in recs if not r["ok"]][:5]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--make-tokenizer", type=Path, help="write the synthetic tokenizer to this folder and exit")
    ap.add_argument("--base-url", default="http://127.0.0.1:30200")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--max-new", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--trials", type=int, default=5, help="TTFT: requests of each kind")
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--skip", default="", help="comma list of parts to skip: throughput,ttft,validity")
    args = ap.parse_args()
    if args.make_tokenizer:
        make_tokenizer(args.make_tokenizer, VOCAB)
        return
    import httpx

    with httpx.Client(base_url=args.base_url) as client:
        info = client.get("/server_info", timeout=60).json()
        overlap = info.get("config", {}).get("runtime", {}).get("overlap")
        print(f"server up; runtime.overlap={overlap} (None: on for CUDA)", flush=True)
        skip = set(filter(None, args.skip.split(",")))
        summary = {"overlap": overlap}
        if "throughput" not in skip:
            summary["throughput"] = throughput(client, args)
        if "ttft" not in skip:
            summary["ttft"] = first_token(client, args)
            print("ttft done", flush=True)
        if "validity" not in skip:
            summary["validity"] = validity(client, args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "structured_output_gpu.json").write_text(json.dumps(summary, indent=1))
    if "throughput" in summary:
        t = summary["throughput"]
        ahead = sum(r["launched_ahead"] for r in t["constrained"])
        decodes = sum(r["decode_batches"] for r in t["constrained"])
        print(f"batch {t['batch']} decode: unconstrained {t['median_unconstrained_tok_s']} tok/s, constrained "
              f"{t['median_constrained_tok_s']} tok/s, ratio {t['constrained_over_unconstrained']} (target >= 0.95); "
              f"constrained decode batches launched ahead: {ahead}/{decodes}")
    if "ttft" in summary:
        f = summary["ttft"]
        print(f"TTFT (1-token /generate, {args.input_len}-token prompt): unconstrained {f['median_unconstrained_ms']} ms, "
              f"uncached grammar {f['median_uncached_grammar_ms']} ms, difference {f['median_difference_ms']} ms "
              f"(target <= 50); trials {f['unconstrained_ms']} / {f['uncached_grammar_ms']}")
    if "validity" in summary:
        v = summary["validity"]
        print(f"validity: {v['valid']}/{v['requests']} valid ({v['checked_with']})")
        if v["failures"]:
            print(json.dumps(v["failures"], indent=1))


if __name__ == "__main__":
    main()
