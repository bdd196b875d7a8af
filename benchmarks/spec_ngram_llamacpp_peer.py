"""Peer for benchmarks/spec_ngram_cpu.py: llama.cpp (llama-cpp-python) with and without its prompt
lookup decoding, on the same SmolLM2 GGUF and the same copy-heavy chat prompts, batch 1, greedy.

Needs `pip install llama-cpp-python` (compiles llama.cpp: about 6.5 minutes; not part of the
project's requirements). Appends a markdown block (machine, commit, command) to --out.

    python benchmarks/spec_ngram_llamacpp_peer.py --max-new-tokens 128 --num-pred-tokens 4
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_env import commit, machine  # noqa: E402
from spec_ngram_cpu import first_difference, smollm2_path  # noqa: E402
from spec_ngram_prompts import WARMUP_MESSAGE, chat_messages  # noqa: E402


def run(name: str, llm, messages: list[str], max_new_tokens: int) -> dict:
    def chat(msg: str) -> dict:
        return llm.create_chat_completion(messages=[{"role": "user", "content": msg}], temperature=0.0,
                                          max_tokens=max_new_tokens)

    chat(WARMUP_MESSAGE)
    rows = []
    for i, msg in enumerate(messages):
        start = time.perf_counter()
        out = chat(msg)
        wall = time.perf_counter() - start
        text = out["choices"][0]["message"]["content"] or ""
        rows.append({"tokens": out["usage"]["completion_tokens"], "wall": wall,
                     "ids": llm.tokenize(text.encode(), add_bos=False, special=True)})
        print(f"{name} prompt {i}: {rows[-1]['tokens']} tokens in {wall:.2f} s", flush=True)
    tokens, wall = sum(r["tokens"] for r in rows), sum(r["wall"] for r in rows)
    return {"name": name, "rows": rows, "tokens": tokens, "wall": wall, "tok_s": tokens / wall}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--num-pred-tokens", type=int, default=4, help="tokens drafted per lookup")
    ap.add_argument("--max-ngram-size", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/cpu-spec-ngram.md")
    args = ap.parse_args()
    try:
        import llama_cpp
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    except ImportError:
        raise SystemExit("llama-cpp-python is not installed: pip install llama-cpp-python (compiles ~6.5 min)") from None
    model = args.model or smollm2_path()
    messages = chat_messages()[: args.prompts or None]
    common = dict(model_path=model, n_ctx=4096, n_threads=args.threads, n_threads_batch=args.threads, verbose=False)
    plain = run("llama.cpp plain", Llama(**common), messages, args.max_new_tokens)
    draft = LlamaPromptLookupDecoding(max_ngram_size=args.max_ngram_size, num_pred_tokens=args.num_pred_tokens)
    lookup = run(f"llama.cpp lookup k={args.num_pred_tokens}", Llama(**common, draft_model=draft), messages,
                 args.max_new_tokens)
    lines = [
        f"## {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: peer, llama.cpp prompt lookup decoding "
        f"(llama-cpp-python {llama_cpp.__version__}), {len(messages)} prompts x {args.max_new_tokens} tokens",
        "",
        f"- machine: {machine()}",
        f"- commit: {commit()}",
        f"- command: `python {' '.join(shlex.quote(a) for a in sys.argv)}`",
        f"- model: {Path(model).name} (the file itself), {args.threads} threads, greedy, max_ngram_size "
        f"{args.max_ngram_size}",
        "",
        "| run | output tokens | time (s) | tok/s | speed-up | outputs identical |",
        "|---|---|---|---|---|---|",
    ]
    for r in (plain, lookup):
        diffs = [f"prompt {i} at token {at}" for i, (a, b) in enumerate(zip(r["rows"], plain["rows"]))
                 if (at := first_difference(a["ids"], b["ids"])) is not None]
        lines.append(f"| {r['name']} | {r['tokens']} | {r['wall']:.2f} | {r['tok_s']:.1f} | "
                     f"{r['tok_s'] / plain['tok_s']:.2f}x | {'yes' if not diffs else 'NO: ' + '; '.join(diffs)} |")
    text = "\n".join(lines) + "\n\n"
    print(text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("a") as f:
        f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
