# ruff: noqa: B023  (each lambda is timed before the loop variables change)
"""Batch-1 low-bit GEMVs (radixserve.layers.lowbit_gemv) on the Llama-3.1-8B projection shapes vs bf16
cuBLAS and the split-K int4 fused_gemm: per-shape us, bytes moved, TB/s, max error vs the
dequantized reference. ~60-90 s on an H200.

    python benchmarks/h200/lowbit_gemv.py [--out DIR]     (writes lowbit_gemv.json)

Timing: CUDA-graph replay over enough weight copies (> 256 MB) that each call streams from HBM."""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.nn.functional as F
from radixserve.layers import int4_triton
from radixserve.layers import lowbit_gemv as lg
from radixserve.layers.quant_int4 import make_int4_weight

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}  # (N, K)
INT4_CFGS = [lg.LowbitConfig(*c) for c in [(8, 1024, 4, 3), (4, 1024, 4, 3), (16, 512, 4, 3), (8, 512, 4, 4),
                                            (4, 2048, 8, 2)]]
FP8_CFGS = [lg.LowbitConfig(*c) for c in [(16, 512, 4, 3), (8, 1024, 4, 3), (8, 512, 4, 3), (4, 2048, 8, 2)]]


def time_graph(fn, objs, reps=10):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for o in objs:
            fn(o)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for o in objs:
            fn(o)
    g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        g.replay()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) * 1e3 / reps / len(objs)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    torch.manual_seed(0)
    dev, res, t0 = "cuda", {}, time.time()
    for name, (n, k) in SHAPES.items():
        row = {}
        x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        # bf16 cuBLAS
        copies = max(2, -(-256 * 2**20 // (n * k * 2)))
        wb = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        us = time_graph(lambda w: F.linear(x, w), wb)
        row["bf16_cublas"] = {"us": us, "bytes": n * k * 2, "TBps": n * k * 2 / us / 1e6}
        del wb
        # int4 g128
        g = 128
        copies = max(2, -(-256 * 2**20 // (n * k // 2)))
        ws = []
        for _ in range(copies):
            codes = torch.randint(0, 16, (k, n), device=dev)
            sc = torch.rand(k // g, n, device=dev) * 0.01
            z = torch.randint(0, 16, (k // g, n), device=dev).float()
            ws.append(make_int4_weight(codes, sc, z, torch.arange(k, device=dev) // g, torch.bfloat16, packed=False))
        rs = [lg.repack_int4(w) for w in ws]
        ref = x.float() @ ws[0].dequantize(torch.float32)
        scale = ref.abs().max().item()
        best = None
        for cfg in INT4_CFGS:
            try:
                err = (lg.int4_gemv(x, rs[0], cfg).float() - ref).abs().max().item() / scale
                us = time_graph(lambda r, c=cfg: lg.int4_gemv(x, r, c), rs)
            except Exception as e:  # a config that does not compile is reported, not fatal
                print(name, "int4", cfg, "failed:", repr(e)[:200], flush=True)
                continue
            print(f"{name} int4 {cfg} {us:.1f} us rel_err {err:.2e}", flush=True)
            if best is None or us < best["us"]:
                best = {"us": us, "cfg": list(cfg.__dict__.values()), "rel_err": err}
        best = best or {"us": float("nan"), "cfg": None, "rel_err": None}
        nbytes = rs[0].nbytes
        best.update(bytes=nbytes, TBps=nbytes / best["us"] / 1e6)
        row["int4_gemv"] = best
        us = time_graph(lambda w: int4_triton.fused_gemm(x, w), ws)
        row["int4_splitk_fused"] = {"us": us, "rel_err": (int4_triton.fused_gemm(x, ws[0]).float() - ref).abs().max().item() / scale}
        for m in (2, 4):
            xm = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            cfg = INT4_CFGS[0]
            refm = xm.float() @ ws[0].dequantize(torch.float32)
            row[f"int4_gemv_M{m}"] = {"us": time_graph(lambda r: lg.int4_gemv(xm, r, cfg), rs),
                                      "rel_err": (lg.int4_gemv(xm, rs[0], cfg).float() - refm).abs().max().item() / refm.abs().max().item()}
        del ws, rs
        # fp8 per-channel
        copies = max(2, -(-256 * 2**20 // (n * k)))
        wf = [(torch.randn(n, k, device=dev) * 100).to(torch.float8_e4m3fn) for _ in range(copies)]
        sr = torch.rand(n, device=dev) * 1e-3
        reff = x.float() @ (wf[0].float() * sr[:, None]).t()
        best = None
        for cfg in FP8_CFGS:
            err = (lg.fp8_gemv(x, wf[0], sr, cfg).float() - reff).abs().max().item() / reff.abs().max().item()
            us = time_graph(lambda w, c=cfg: lg.fp8_gemv(x, w, sr, c), wf)
            print(f"{name} fp8 {cfg} {us:.1f} us rel_err {err:.2e}", flush=True)
            if best is None or us < best["us"]:
                best = {"us": us, "cfg": list(cfg.__dict__.values()), "rel_err": err}
        best.update(bytes=n * k, TBps=n * k / best["us"] / 1e6)
        row["fp8_gemv"] = best
        try:  # the fp8 plugin's current small-M path (tiled Triton GEMM, bf16 activations)
            from radixserve_quant_fp8 import kernels as fk
            row["fp8_block_gemm_now"] = {"us": time_graph(lambda w: fk.block_fp8_gemm(x, w, sr[:, None], (1, k)), wf)}
        except Exception as e:
            print("fp8 block_fp8_gemm failed:", repr(e)[:200], flush=True)
        del wf
        res[name] = row
        print(name, json.dumps({k2: round(v["us"], 1) for k2, v in row.items()}), f"t={time.time() - t0:.0f}s",
              flush=True)
    tot = {key: sum(res[s][key]["us"] for s in SHAPES) for key in ("bf16_cublas", "int4_gemv", "fp8_gemv",
                                                                  "int4_splitk_fused")}
    res["per_layer_sum_us"] = tot
    res["speedup_vs_bf16"] = {key: tot["bf16_cublas"] / v for key, v in tot.items()}
    print(json.dumps(res["per_layer_sum_us"]), json.dumps(res["speedup_vs_bf16"]), flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "lowbit_gemv.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
