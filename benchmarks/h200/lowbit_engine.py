"""Batch-1 decode of the Llama-3.1-8B shape (dummy weights, CUDA graphs, the ModelRunner path the Engine
drives) for bf16, AWQ int4 g128 and FP8 online, with the low-bit GEMVs (radixserve.layers.lowbit_gemv)
off and on: ms per decode step and the speedup vs bf16 (whose batch-1 projections run the Triton GEMV).
Also the greedy tokens of the low-bit runs with the GEMVs on vs off (same dummy weights: seeded init).
~3 min on an H200 (five model loads).

    python benchmarks/h200/lowbit_engine.py [--out DIR]    (writes lowbit_engine.json)

Each load sets the config key runtime.lowbit_gemv (the loader asks each quantized linear's method to prepare
for the GEMVs, `QuantMethod.enable_lowbit_gemv`): int4 keeps a row-layout copy, per-row fp8 layers are flagged."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # benchmarks/: h200_quant (the dummy quantized checkpoints)
import h200_quant as hq  # noqa: E402
from radixserve.static_batch import run_static_batch  # noqa: E402

RUNS = [("bf16", False), ("awq", False), ("awq", True), ("fp8", False), ("fp8", True)]
T0 = time.time()


def _lowbit_layers(model) -> int:
    """Linears that run batch 1 on the low-bit GEMVs: int4 with a row-layout copy, fp8 flagged."""
    return sum(getattr(getattr(m, "int4_weight", None), "rows", None) is not None or getattr(m, "fp8_row_gemv", False)
               for m in model.modules())


def log(msg):
    print(f"[lowbit_engine {time.time() - T0:5.0f}s] {msg}", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--runs", default=",".join(f"{m}:{int(on)}" for m, on in RUNS))
    args = ap.parse_args()
    hq.ARGS.device, hq.ARGS.model_config = "cuda", hq.LLAMA_8B
    rows, tokens = [], {}
    with tempfile.TemporaryDirectory() as root:
        for spec in args.runs.split(","):
            method, on = spec.split(":")
            key = f"{method} lowbit={'on' if on == '1' else 'off'}"
            log(f"loading {key}")
            try:
                torch.manual_seed(0)
                t = time.time()
                runner = hq.make_runner(method, root, 1, args.input_len + args.output_len + 64,
                                        args.input_len + args.output_len + 16,
                                        runtime={"lowbit_gemv": "on" if on == "1" else "off"})
                load_s = time.time() - t
                gen = torch.Generator().manual_seed(0)
                prompt = torch.randint(10, 30000, (args.input_len,), generator=gen).tolist()
                run_static_batch(runner, [prompt], max_new_tokens=2)  # warm-up: compile, capture graphs
                res = run_static_batch(runner, [prompt], max_new_tokens=args.output_len)
            except Exception as e:  # noqa: BLE001 - recorded, the next run still goes
                rows.append({"run": key, "error": f"{type(e).__name__}: {str(e)[:500]}"})
                log(f"{key} failed: {e}")
                runner = None
                hq.free()
                continue
            step_ms = statistics.median(res.decode_step_s) * 1e3
            tokens[key] = res.output_ids[0]
            rows.append({"run": key, "method": method, "lowbit_gemv_layers": _lowbit_layers(runner.model),
                         "decode_ms_per_step_p50": round(step_ms, 3), "tok_s": round(1e3 / step_ms, 1),
                         "cuda_graph": res.used_cuda_graph, "load_s": round(load_s, 1),
                         "gpu_mem_gb": round(torch.cuda.memory_allocated() / 2**30, 2)})
            log(f"{key}: {step_ms:.3f} ms/step ({1e3 / step_ms:.1f} tok/s, graph={res.used_cuda_graph})")
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "lowbit_engine.json"), "w") as f:  # partial rows survive a timeout
                json.dump({"rows": rows}, f, indent=1)
            runner = None
            hq.free()
    base = next((r["decode_ms_per_step_p50"] for r in rows if r.get("method") == "bf16"), None)
    for r in rows:
        if base and "decode_ms_per_step_p50" in r:
            r["speedup_vs_bf16"] = round(base / r["decode_ms_per_step_p50"], 3)
    same = {}
    for method in ("awq", "fp8"):
        a, b = tokens.get(f"{method} lowbit=off"), tokens.get(f"{method} lowbit=on")
        if a and b:
            same[method] = {"equal_prefix": next((i for i, (u, v) in enumerate(zip(a, b)) if u != v), len(a)),
                            "of": len(a)}
    out = {"rows": rows, "greedy_tokens_on_vs_off": same, "input_len": args.input_len, "output_len": args.output_len,
           "device": torch.cuda.get_device_name()}
    for r in rows:
        log(json.dumps(r))
    log("greedy on vs off: " + json.dumps(same))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "lowbit_engine.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
