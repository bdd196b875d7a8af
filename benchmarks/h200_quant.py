"""Quantized linears on one GPU (written for the H200): kernel correctness at Llama-3.1-8B shapes,
GEMM times, and decode / offline throughput of the 8B shape (random weights) for bf16, AWQ int4,
GPTQ int4 (group 128) and FP8 (online, W8A8). Bounded to about 5 minutes; prints progress.

    source benchmarks/h200/setup.sh && \\
      python3 -m pip install -q --no-deps --no-build-isolation -e ./plugins/quantization/awq \\
        -e ./plugins/quantization/gptq -e ./plugins/quantization/fp8 && \\
      python3 benchmarks/h200_quant.py --out $OUT

Writes $OUT/h200_quant.json (every number) and $OUT/h200_quant.md (tables). Sections can be
skipped (--skip kernels,decode,offline) and the sizes changed (--decode-batches, --offline-*).
Each model run is in this process, one after another, freeing the GPU in between; a failing
section is recorded with its error and the next one still runs."""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
import traceback

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
LLAMA_8B = os.path.join(HERE, "model-configs", "llama-3.1-8b")
# (name, K in, N out) of the Llama-3.1-8B linears
SHAPES = [("qkv", 4096, 6144), ("o", 4096, 4096), ("gate_up", 4096, 28672), ("down", 14336, 4096)]
QUANT_CONFIGS = {
    "awq": {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"},
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True,
             "checkpoint_format": "gptq"},
}
results: dict = {"sections": {}}
ARGS = argparse.Namespace(device="cuda", model_config=LLAMA_8B)  # replaced by main()
T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:6.1f}s] {msg}", flush=True)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm().clamp(min=1e-30))


def bench_ms(fn, rep_ms: int = 200) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median"))


# ---- kernels at real shapes ----------------------------------------------------------------------
def random_int4(k: int, n: int, group: int, dtype, act_order: bool = False):
    from radixserve.layers.quant_int4 import make_int4_weight

    dev = "cuda"
    codes = torch.randint(0, 16, (k, n), device=dev, dtype=torch.int32)
    scales = torch.rand(k // group, n, device=dev) * 0.01 + 0.001
    zeros = torch.randint(0, 16, (k // group, n), device=dev).float()
    g_idx = torch.arange(k, device=dev) // group
    if act_order:
        g_idx = g_idx[torch.randperm(k, device=dev)]
    return make_int4_weight(codes, scales, zeros, g_idx, dtype, packed=False)


def kernels_section(args) -> dict:
    from radixserve.layers import int4_triton
    from radixserve.layers.quant_int4 import int4_linear
    from radixserve_quant_fp8 import kernels as fp8k

    rows = []
    results["int4_unpack_default"] = int4_triton.UNPACK
    dtype = torch.bfloat16
    for name, k, n in SHAPES:
        w = random_int4(k, n, 128, dtype)
        ref_w = w.dequantize(torch.float32)  # Triton dequant kernel: check it once against torch
        from radixserve.layers.quant_int4 import unpack_int4

        torch_w = (unpack_int4(w.qweight, 0).float() - w.zeros[w.g_idx.long()].float()) * w.scales[w.g_idx.long()].float()
        dq_err = rel_err(ref_w, torch_w)
        w_bf16 = torch.randn(k, n, device="cuda", dtype=dtype) * 0.02
        wt_fp8 = (torch.randn(n, k, device="cuda") * 2).to(torch.float8_e4m3fn)
        row_scale = torch.rand(n, device="cuda") * 0.01 + 1e-3
        blk_scale = torch.rand(n // 128, k // 128, device="cuda") * 0.01 + 1e-3
        blk_ref = wt_fp8.float() * blk_scale.repeat_interleave(128, 0).repeat_interleave(128, 1)
        for m in args.kernel_rows:
            x = torch.randn(m, k, device="cuda", dtype=dtype)
            out = {"layer": name, "K": k, "N": n, "M": m, "int4_dequant_kernel_rel_err": dq_err}
            y = int4_linear(x, w, None)
            out["int4_rel_err"] = rel_err(y, x.float() @ ref_w)
            out["int4_ms"] = bench_ms(lambda x=x, w=w: int4_linear(x, w, None))
            if m <= 64:  # the other way of unpacking codes in the fused kernel (int4_triton.UNPACK)
                default = int4_triton.UNPACK
                int4_triton.UNPACK = "reshape" if default == "repeat" else "repeat"
                try:
                    out[f"int4_{int4_triton.UNPACK}_rel_err"] = rel_err(int4_linear(x, w, None), x.float() @ ref_w)
                    out[f"int4_{int4_triton.UNPACK}_ms"] = bench_ms(lambda x=x, w=w: int4_linear(x, w, None))
                finally:
                    int4_triton.UNPACK = default
            out["bf16_ms"] = bench_ms(lambda x=x, w_bf16=w_bf16: x @ w_bf16)
            y8 = fp8k.scaled_mm_linear(x, wt_fp8, row_scale)
            if y8 is not None:
                xq, xs = fp8k.quantize_per_token(x)  # W8A8: the reference quantizes activations the same way
                out["fp8_rowwise_rel_err"] = rel_err(y8, (xq.float() * xs) @ (wt_fp8.float() * row_scale[:, None]).T)
                out["fp8_rowwise_ms"] = bench_ms(lambda x=x, w8=wt_fp8, rs=row_scale: fp8k.scaled_mm_linear(x, w8, rs))
            if m <= 64:  # the Triton W8A16 path with one scale per row (decode-sized batches)
                rs2 = row_scale[:, None]
                yt = fp8k.block_fp8_gemm(x, wt_fp8, rs2, (1, k))
                out["fp8_triton_rowwise_rel_err"] = rel_err(yt, x.float() @ (wt_fp8.float() * row_scale[:, None]).T)
                out["fp8_triton_rowwise_ms"] = bench_ms(lambda x=x, w8=wt_fp8, rs=rs2, k=k: fp8k.block_fp8_gemm(x, w8, rs, (1, k)))
            yb = fp8k.block_fp8_linear(x, wt_fp8, blk_scale, (128, 128))
            out["fp8_block_rel_err"] = rel_err(yb, x.float() @ blk_ref.T)
            out["fp8_block_ms"] = bench_ms(lambda x=x, w8=wt_fp8, bs=blk_scale: fp8k.block_fp8_linear(x, w8, bs, (128, 128)))
            for key in ("int4", "fp8_rowwise", "fp8_triton_rowwise", "fp8_block"):
                if f"{key}_ms" in out:
                    out[f"{key}_speedup_vs_bf16"] = round(out["bf16_ms"] / out[f"{key}_ms"], 2)
            rows.append(out)
            alt = [f"{k2[5:-3]} {v:.3f} ms" for k2, v in out.items() if k2.startswith("int4_re") and k2.endswith("_ms")]
            log(f"kernel {name} M={m}: int4 {out['int4_ms']:.3f} ms (err {out['int4_rel_err']:.1e}; other unpack: {alt}), bf16 "
                f"{out['bf16_ms']:.3f} ms, fp8 rowwise {out.get('fp8_rowwise_ms', float('nan')):.3f} ms, "
                f"fp8 block {out['fp8_block_ms']:.3f} ms (err {out['fp8_block_rel_err']:.1e})")
        del w, ref_w, torch_w, w_bf16, wt_fp8, blk_ref
        torch.cuda.empty_cache()
    # act-order (GPTQ desc_act) on one shape: the permuted input path
    w = random_int4(4096, 4096, 128, dtype, act_order=True)
    x = torch.randn(4, 4096, device="cuda", dtype=dtype)
    y = int4_linear(x, w, None)
    rows.append({"layer": "o (act-order)", "K": 4096, "N": 4096, "M": 4,
                 "int4_rel_err": rel_err(y, x[:, w.perm].float() @ w.dequantize(torch.float32))})
    bad = [r for r in rows if any(k.endswith("rel_err") and v > 2e-2 for k, v in r.items())]
    return {"rows": rows, "all_correct": not bad, "tolerance": 2e-2,
            "note": "rel_err = ||y - x @ dequant(W)||/||x @ dequant(W)|| (fp32 reference); bf16 outputs"}


# ---- the model: decode and offline throughput -----------------------------------------------------
def model_dir(method: str, root: str) -> str:
    """The model config (8B by default), with quantization_config for the checkpoint formats
    (dummy weights)."""
    if method not in QUANT_CONFIGS:
        return ARGS.model_config
    path = os.path.join(root, f"model-{method}")
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(ARGS.model_config, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = QUANT_CONFIGS[method]
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return path


def make_runner(method: str, root: str, max_bs: int, tokens: int, context: int, runtime: dict | None = None):
    """A ModelRunner on the dummy checkpoint of `method`; `runtime`: more runtime config keys."""
    from radixserve.config import Config
    from radixserve.model_runner import ModelRunner

    cuda = ARGS.device == "cuda"
    cfg = {
        "model": {"path": model_dir(method, root), "load_format": "dummy", "context_length": context},
        "runtime": {"device": ARGS.device, "dtype": "bfloat16" if cuda else "float32", **(runtime or {})},
        "scheduler": {"max_running_requests": max_bs, "max_total_tokens": tokens},
        "stack": {"attention": "triton" if cuda else "torch_native",
                  **({"quantization": "fp8"} if method == "fp8" else {})},
    }
    return ModelRunner(Config.build(cfg), show_progress=False)


def free(*objs) -> None:
    del objs
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def sync() -> None:
    if ARGS.device == "cuda":
        torch.cuda.synchronize()


def decode_section(args, root: str) -> dict:
    import statistics

    from radixserve.static_batch import run_static_batch

    rows = []
    max_bs = max(args.decode_batches)
    for method in args.methods:
        log(f"decode: loading {method}")
        t = time.perf_counter()
        offline = method in ("bf16", "fp8") and args.static_offline  # same runner: one load fewer
        bs_cap = max(max_bs, args.offline_batch) if offline else max_bs
        tokens = max_bs * (args.decode_input + args.decode_output) + 64
        context = args.decode_input + args.decode_output + 16
        if offline:
            tokens = max(tokens, args.offline_batch * (args.offline_input + args.offline_output) + 64)
            context = max(context, args.offline_input + args.offline_output + 16)
        try:
            runner = make_runner(method, root, bs_cap, tokens, context, runtime=args.runtime)
        except Exception as e:  # noqa: BLE001 - recorded, the next method still runs
            rows.append({"method": method, "error": f"{type(e).__name__}: {e}"})
            log(f"decode: {method} failed to load: {e}")
            continue
        load_s = time.perf_counter() - t
        weights_gb = torch.cuda.memory_allocated() / 2**30 if ARGS.device == "cuda" else 0.0
        for bs in args.decode_batches:
            gen = torch.Generator().manual_seed(bs)
            prompts = [torch.randint(10, min(30000, runner.vocab_size - 10), (args.decode_input,), generator=gen).tolist() for _ in range(bs)]
            run_static_batch(runner, prompts, max_new_tokens=2)  # warm-up: compile, capture graphs
            res = run_static_batch(runner, prompts, max_new_tokens=args.decode_output)
            step_ms = statistics.median(res.decode_step_s) * 1e3
            row = {"method": method, "batch_size": bs, "decode_ms_per_step_p50": round(step_ms, 3),
                   "decode_tok_s": round(bs * 1e3 / step_ms, 1), "prefill_s": round(res.prefill_s, 3),
                   "cuda_graph": res.used_cuda_graph, "load_s": round(load_s, 1), "gpu_mem_gb_after_load": round(weights_gb, 2)}
            rows.append(row)
            log(f"decode {method} bs={bs}: {row['decode_tok_s']} tok/s ({step_ms:.2f} ms/step, graph={res.used_cuda_graph})")
        if offline:
            try:
                STATIC_OFFLINE_ROWS.append(static_offline(runner, method, args))
            except Exception as e:  # noqa: BLE001
                STATIC_OFFLINE_ROWS.append({"method": method, "error": f"{type(e).__name__}: {e}"})
        runner = None
        free()
    base = {r["batch_size"]: r["decode_tok_s"] for r in rows if r.get("method") == "bf16" and "decode_tok_s" in r}
    for r in rows:
        if "decode_tok_s" in r and r["batch_size"] in base:
            r["speedup_vs_bf16"] = round(r["decode_tok_s"] / base[r["batch_size"]], 2)
    return {"rows": rows, "input_len": args.decode_input, "output_len": args.decode_output}


def engine_offline_section(args) -> dict:
    """Offline throughput through the Engine (scheduler, radix cache, CUDA graphs), as
    benchmarks/offline_throughput.py measures it: all prompts submitted at once; bf16 then fp8."""
    import random

    from radixserve.config import Config
    from radixserve.engine import Engine

    rows = []
    n, n_in, n_out = args.offline_prompts, args.offline_input, args.offline_output
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 30000) for _ in range(n_in)] for _ in range(n)]
    params = {"max_new_tokens": n_out, "ignore_eos": True, "temperature": 0.0}
    for method in ("bf16", "fp8"):
        over = {"model": {"path": ARGS.model_config, "load_format": "dummy", "tokenizer": args.tokenizer,
                          "context_length": n_in + n_out + 16}}
        if method == "fp8":
            over["stack"] = {"quantization": "fp8"}
        if args.runtime:
            over["runtime"] = dict(args.runtime)
        log(f"offline (engine): starting {method}")
        try:
            with Engine(config=Config.load(args.offline_config, over)) as engine:
                engine.generate(input_ids=prompts[:4], sampling_params={**params, "max_new_tokens": 4})  # warm-up
                t = time.perf_counter()
                outs = engine.generate(input_ids=prompts, sampling_params=params)
                dt = time.perf_counter() - t
        except Exception as e:  # noqa: BLE001
            rows.append({"method": method, "error": f"{type(e).__name__}: {e}"})
            log(f"offline (engine) {method} failed: {e}")
            continue
        got_out = sum(o["meta_info"]["completion_tokens"] for o in outs)
        got_in = sum(o["meta_info"]["prompt_tokens"] for o in outs)
        row = {"method": method, "prompts": n, "input_len": n_in, "output_len": n_out, "seconds": round(dt, 2),
               "output_tok_s": round(got_out / dt, 1), "total_tok_s": round((got_in + got_out) / dt, 1),
               "engine": True, "config": args.offline_config}
        rows.append(row)
        log(f"offline (engine) {method}: {row['output_tok_s']} output tok/s, {row['total_tok_s']} total tok/s in {dt:.1f}s")
        free()
    ok = {r["method"]: r for r in rows if "output_tok_s" in r}
    if "bf16" in ok and "fp8" in ok:
        results["fp8_offline_speedup_vs_bf16"] = round(ok["fp8"]["total_tok_s"] / ok["bf16"]["total_tok_s"], 2)
    return {"rows": rows, "note": f"Engine, config {args.offline_config}, random token ids, dummy weights"}


STATIC_OFFLINE_ROWS: list[dict] = []


def static_offline(runner, method: str, args) -> dict:
    """Offline throughput in static batches (waves of --offline-batch prompts, each prefilled then
    decoded together), bounded by --offline-budget-s."""
    from radixserve.static_batch import run_static_batch

    n, bs = args.offline_prompts, args.offline_batch
    gen = torch.Generator().manual_seed(0)
    high = min(30000, runner.vocab_size - 10)
    prompts = [torch.randint(10, high, (args.offline_input,), generator=gen).tolist() for _ in range(n)]
    run_static_batch(runner, prompts[:bs], max_new_tokens=2)
    sync()
    t = time.perf_counter()
    for i in range(0, n, bs):
        run_static_batch(runner, prompts[i : i + bs], max_new_tokens=args.offline_output)
        if time.perf_counter() - t > args.offline_budget_s:
            n = min(n, i + bs)  # bounded: report what ran
            break
    sync()
    dt = time.perf_counter() - t
    row = {"method": method, "prompts": n, "input_len": args.offline_input, "output_len": args.offline_output,
           "wave_batch": bs, "seconds": round(dt, 2), "output_tok_s": round(n * args.offline_output / dt, 1),
           "total_tok_s": round(n * (args.offline_input + args.offline_output) / dt, 1)}
    log(f"offline {method}: {row['output_tok_s']} output tok/s over {n} prompts in {dt:.1f}s")
    return row


def offline_section(args, root: str) -> dict:
    """The static-batch offline rows the decode section measured on its bf16 and fp8 runners
    (or, when the decode section was skipped, fresh runners)."""
    rows = STATIC_OFFLINE_ROWS
    if not rows:
        for method in ("bf16", "fp8"):
            log(f"offline: loading {method}")
            try:
                runner = make_runner(method, root, args.offline_batch,
                                     args.offline_batch * (args.offline_input + args.offline_output) + 64,
                                     args.offline_input + args.offline_output + 16, runtime=args.runtime)
                rows.append(static_offline(runner, method, args))
            except Exception as e:  # noqa: BLE001
                rows.append({"method": method, "error": f"{type(e).__name__}: {e}"})
            runner = None
            free()
    ok = {r["method"]: r for r in rows if "output_tok_s" in r}
    if "bf16" in ok and "fp8" in ok:
        results["fp8_offline_speedup_vs_bf16"] = round(ok["fp8"]["total_tok_s"] / ok["bf16"]["total_tok_s"], 2)
    return {"rows": rows, "note": "static batches through ModelRunner (no scheduler); same prompts for both"}


# ---- report --------------------------------------------------------------------------------------
def markdown() -> str:
    lines = [f"# Quantized linears on {results.get('device')}", "",
             f"commit {results.get('commit')}, torch {results.get('torch')}, triton {results.get('triton')}, "
             f"command: `{results.get('command')}`", ""]
    k = results["sections"].get("kernels", {})
    if k.get("rows"):
        lines += ["## Kernels at Llama-3.1-8B shapes (bf16 activations, g128 int4)", "",
                  f"all within rel_err {k.get('tolerance')}: **{k.get('all_correct')}**", "",
                  f"int4 unpacking: default `{results.get('int4_unpack_default')}`; the other one in its own column", "",
                  "| layer | M | int4 ms | int4 other unpack ms | bf16 ms | int4 x | fp8 _scaled_mm ms | x | fp8 Triton rowwise ms | x | fp8 block ms | x | int4 err | fp8 block err |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in k["rows"]:
            f = lambda key, fmt="{:.3f}", r=r: fmt.format(r[key]) if key in r else "-"  # noqa: E731
            alt = next((f"{v:.3f}" for key, v in r.items() if key.startswith("int4_re") and key.endswith("_ms")), "-")
            lines.append(f"| {r['layer']} | {r['M']} | {f('int4_ms')} | {alt} | {f('bf16_ms')} | {f('int4_speedup_vs_bf16', '{}')} | "
                         f"{f('fp8_rowwise_ms')} | {f('fp8_rowwise_speedup_vs_bf16', '{}')} | {f('fp8_triton_rowwise_ms')} | "
                         f"{f('fp8_triton_rowwise_speedup_vs_bf16', '{}')} | {f('fp8_block_ms')} | {f('fp8_block_speedup_vs_bf16', '{}')} | "
                         f"{f('int4_rel_err', '{:.1e}')} | {f('fp8_block_rel_err', '{:.1e}')} |")
        lines.append("")
    d = results["sections"].get("decode", {})
    if d.get("rows"):
        lines += [f"## Decode, {os.path.basename(ARGS.model_config.rstrip('/'))} shape, random weights (input {d['input_len']}, output {d['output_len']})", "",
                  "| method | batch | tok/s | ms/step | x bf16 | GPU GB after load | graph |", "|---|---|---|---|---|---|---|"]
        for r in d["rows"]:
            if "error" in r:
                lines.append(f"| {r['method']} | - | error: {r['error']} | | | | |")
            else:
                lines.append(f"| {r['method']} | {r['batch_size']} | {r['decode_tok_s']} | {r['decode_ms_per_step_p50']} | "
                             f"{r.get('speedup_vs_bf16', '-')} | {r['gpu_mem_gb_after_load']} | {r['cuda_graph']} |")
        lines.append("")
    o = results["sections"].get("offline", {})
    if o.get("rows"):
        lines += [f"## Offline throughput, bf16 vs fp8 ({o.get('note', '')})", "", "| method | prompts | in/out | s | output tok/s | total tok/s |",
                  "|---|---|---|---|---|---|"]
        for r in o["rows"]:
            if "error" in r:
                lines.append(f"| {r['method']} | error: {r['error']} | | | | |")
            else:
                lines.append(f"| {r['method']} | {r['prompts']} | {r['input_len']}/{r['output_len']} | {r['seconds']} | "
                             f"{r['output_tok_s']} | {r['total_tok_s']} |")
        lines += ["", f"fp8 / bf16 total throughput: {results.get('fp8_offline_speedup_vs_bf16', '-')}", ""]
    for name, sec in results["sections"].items():
        if "error" in sec:
            lines += [f"## {name}: FAILED", "", "```", sec["error"], "```", ""]
    return "\n".join(lines)


def apply_kernel_config(path: str) -> dict:
    """Replace the int4 kernels' default launch configs and the GEMV row limit in this process (a benchmark-only
    override: the decode rows then time a sweep's pick; the code's defaults are set from the same file)."""
    from radixserve.layers import int4_rows_gemm, lowbit_gemv, quant_int4

    with open(path) as f:
        picked = json.load(f)
    gemv = lowbit_gemv.LowbitConfig(**picked["gemv"])
    rows = int4_rows_gemm.RowsGemmConfig(**picked["rows_gemm"])
    fp8_default = lowbit_gemv._default
    lowbit_gemv._default = lambda interpret, fp8: fp8_default(interpret, fp8) if fp8 or interpret else gemv
    int4_rows_gemm._default = lambda interpret: rows
    quant_int4.GEMV_MAX_ROWS = int(picked["gemv_max_rows"])
    log(f"kernel config from {path}: GEMV {gemv}, GEMM {rows}, GEMV up to {quant_int4.GEMV_MAX_ROWS} rows")
    return picked


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--skip", default="", help="comma-separated: kernels, decode, offline")
    ap.add_argument("--model-config", default=LLAMA_8B, help="HF config directory (random weights at its shapes)")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of the model sections (tiny --model-config)")
    ap.add_argument("--methods", nargs="+", default=["bf16", "awq", "gptq", "fp8"])
    ap.add_argument("--kernel-rows", type=int, nargs="+", default=[1, 16, 32, 256])
    ap.add_argument("--decode-batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--decode-input", type=int, default=256)
    ap.add_argument("--decode-output", type=int, default=64)
    ap.add_argument("--offline-prompts", type=int, default=128)
    ap.add_argument("--offline-batch", type=int, default=128)
    ap.add_argument("--offline-input", type=int, default=1024)
    ap.add_argument("--offline-output", type=int, default=256)
    ap.add_argument("--offline-budget-s", type=float, default=45.0, help="per method; stops after the wave that passes it")
    ap.add_argument("--tokenizer", help="a tokenizer directory: run the offline section through the Engine "
                                        "(the issue's figure: --offline-prompts 1000) instead of static batches")
    ap.add_argument("--offline-config", default=os.path.join(HERE, "..", "stacks", "h200-llama.yaml"),
                    help="YAML stack of the Engine offline runs")
    ap.add_argument("--kernel-config", help="a kernel_config.json of benchmarks/h200/pick_int4_configs.py: the int4 "
                    "GEMV / tensor-core GEMM launch configs and GEMV row limit for this run (benchmark-only override "
                    "of the code's defaults, to time a sweep's pick in the same call)")
    ap.add_argument("--runtime", nargs="*", default=[], metavar="KEY=VALUE",
                    help="runtime config keys for every model run, e.g. lowbit_gemv=on")
    args = ap.parse_args()
    try:
        args.runtime = dict(item.split("=", 1) for item in args.runtime)
    except ValueError:
        ap.error(f"--runtime takes KEY=VALUE items, got {args.runtime}")
    results["runtime_overrides"] = args.runtime
    if args.kernel_config:
        results["kernel_config"] = apply_kernel_config(args.kernel_config)
    global ARGS
    ARGS = args
    os.makedirs(args.out, exist_ok=True)
    skip = set(filter(None, args.skip.split(",")))
    args.static_offline = "offline" not in skip and not args.tokenizer
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device (pass --device cpu for a smoke run)", file=sys.stderr)
        return 2
    if args.device != "cuda":
        skip.add("kernels")
    import triton
    from bench_env import commit

    cuda = args.device == "cuda"
    results.update(device=torch.cuda.get_device_name() if cuda else "cpu",
                   capability=list(torch.cuda.get_device_capability()) if cuda else None,
                   torch=torch.__version__, triton=triton.__version__, commit=commit(), command=" ".join(sys.argv))
    with tempfile.TemporaryDirectory() as root:
        for name, fn in (("kernels", lambda: kernels_section(args)), ("decode", lambda: decode_section(args, root)),
                         ("offline", lambda: engine_offline_section(args) if args.tokenizer else offline_section(args, root))):
            if name in skip:
                continue
            log(f"section {name}")
            try:
                results["sections"][name] = fn()
            except Exception:  # noqa: BLE001 - recorded; the other sections still run
                results["sections"][name] = {"error": traceback.format_exc()}
                log(f"section {name} FAILED:\n{traceback.format_exc()}")
            free()
            with open(os.path.join(args.out, "h200_quant.json"), "w") as f:  # after each section: partial results survive
                json.dump(results, f, indent=1)
    md = markdown()
    with open(os.path.join(args.out, "h200_quant.md"), "w") as f:
        f.write(md)
    print(md)
    log("done")
    return 0 if all("error" not in s for s in results["sections"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
