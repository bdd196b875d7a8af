# ruff: noqa: B023  (each lambda is timed before the loop variables change)
"""Batched-decode int4 GEMM (radixserve.layers.int4_rows_gemm, tensor cores over the row layout) on the
Llama-3.1-8B projection shapes at 1-64 rows, against bf16 cuBLAS (what a bf16 model runs there), the
split-K dequantizing kernel it replaces (int4_triton.fused_gemm) and, at <= 4 rows, the whole-row GEMV
(lowbit_gemv.int4_gemv, the batch-1 path): per shape and batch the us, TB/s of
the int4 bytes, relative error vs the dequantized bf16 reference, and a sweep of launch configs
(the best per point, and the one config that is best summed over the shapes at each batch).
~2-3 min on an H200 (most of it compiles).

    python benchmarks/h200/int4_rows_gemm.py [--out DIR] [--rows 1 2 4 8 16 32 64]   (writes int4_rows_gemm.json)

Timing: CUDA-graph replay over enough weight copies (> 256 MB) that each call streams from HBM."""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F
from radixserve.layers import int4_triton
from radixserve.layers import lowbit_gemv as lg
from radixserve.layers.int4_rows_gemm import RowsGemmConfig, int4_rows_gemm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from lowbit_gemv import SHAPES, int4_copies, log, rel, time_graph  # noqa: E402  (this folder's GEMV benchmark)

# (prefetch into registers, 1 stage) or (no prefetch, 3 stages: Triton's own pipelining); session 12 call 1 swept
# "planes" widely (its best two are kept), then the one-dot-per-chunk variants beside them
CFGS = [RowsGemmConfig(128, 4, 3, False, None, 4), RowsGemmConfig(128, 4, 1, True, None, 4)] + \
       [RowsGemmConfig(bn, w, st, pf, None, 4, "chunk")
        for bn in (64, 128) for w in (4, 8) for pf, st in ((True, 1), (False, 3))] + \
       [RowsGemmConfig(128, w, st, pf, None, 4, "chunk_xfirst") for w in (4, 8) for pf, st in ((True, 1), (False, 3))] + \
       [RowsGemmConfig(bn, w, st, pf, None, 4, "joined") for bn, w, pf, st in
        ((128, 4, True, 1), (128, 8, True, 1), (64, 4, True, 1), (128, 4, False, 3))] + \
       [RowsGemmConfig(128, 4, st, pf, None, 4, v, "kernel")  # the splits added inside the launch
        for v, pf, st in (("planes", False, 3), ("joined", True, 1), ("chunk", True, 1))]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    ap.add_argument("--shapes", default=",".join(SHAPES))
    args = ap.parse_args()
    torch.manual_seed(0)
    dev, res = "cuda", {"configs": [c.__dict__ for c in CFGS], "points": {}}
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        copies = max(2, -(-256 * 2**20 // (n * k * 2)))
        wb = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        xs = {m: torch.randn(m, k, device=dev, dtype=torch.bfloat16) for m in args.rows}
        bf16 = {m: time_graph(lambda w: F.linear(xs[m], w), wb) for m in args.rows}
        del wb
        ws, _ = int4_copies(n, k, dev)
        rs = [lg.repack_int4(w) for w in ws]
        nbytes = rs[0].nbytes
        deq = ws[0].dequantize(torch.float32).to(torch.bfloat16).float()  # the reference: weights stored in bf16
        for m in args.rows:
            x = xs[m]
            ref = x.float() @ deq
            pt = {"bf16_cublas_us": bf16[m], "int4_bytes": nbytes}
            pt["fused_gemm_us"] = time_graph(lambda w: int4_triton.fused_gemm(x, w), ws)
            pt["fused_gemm_rel_err"] = rel(int4_triton.fused_gemm(x, ws[0]), ref)
            if m <= lg.MAX_ROWS:
                pt["gemv_us"] = time_graph(lambda r: lg.int4_gemv(x, r), rs)
                pt["gemv_rel_err"] = rel(lg.int4_gemv(x, rs[0]), ref)
            pt["rows_gemm"] = {}
            for i, cfg in enumerate(CFGS):
                try:
                    err = rel(int4_rows_gemm(x, rs[0], cfg), ref)
                    us = time_graph(lambda r: int4_rows_gemm(x, r, cfg), rs)
                except Exception as e:  # a config that does not compile is reported, not fatal
                    log(f"{name} M{m} {cfg} failed: {repr(e)[:300]}")
                    continue
                pt["rows_gemm"][i] = {"us": us, "rel_err": err}
            best_i = min(pt["rows_gemm"], key=lambda i: pt["rows_gemm"][i]["us"])
            best = pt["rows_gemm"][best_i]
            default = RowsGemmConfig()
            pt["default_us"] = time_graph(lambda r: int4_rows_gemm(x, r), rs)
            gemv = f"gemv {pt['gemv_us']:.1f} us | " if "gemv_us" in pt else ""
            log(f"{name} M{m}: bf16 {bf16[m]:.1f} us | fused {pt['fused_gemm_us']:.1f} us | {gemv}rows default "
                f"{pt['default_us']:.1f} us | best {best['us']:.1f} us ({nbytes / best['us'] / 1e6:.2f} TB/s, "
                f"err {best['rel_err']:.1e}) {CFGS[best_i]} | default {default}")
            res["points"][f"{name}/M{m}"] = pt
        del ws, rs
        torch.cuda.empty_cache()
    # the one config best summed over the shapes, per batch
    res["best_overall"] = {}
    for m in args.rows:
        pts = [res["points"][f"{s}/M{m}"] for s in args.shapes.split(",")]
        totals = {i: sum(p["rows_gemm"].get(i, {"us": 1e9})["us"] for p in pts) for i in range(len(CFGS))}
        i = min(totals, key=totals.get)
        summary = {"config": CFGS[i].__dict__, "sum_us": totals[i], "sum_default_us": sum(p["default_us"] for p in pts),
                   "sum_fused_us": sum(p["fused_gemm_us"] for p in pts),
                   "sum_bf16_us": sum(p["bf16_cublas_us"] for p in pts),
                   "sum_gemv_us": sum(p.get("gemv_us", float("nan")) for p in pts)}
        res["best_overall"][m] = summary
        log(f"M{m} summed over shapes: best {summary['sum_us']:.1f} us {CFGS[i]} | default {summary['sum_default_us']:.1f}"
            f" | fused {summary['sum_fused_us']:.1f} | gemv {summary['sum_gemv_us']:.1f} | bf16 {summary['sum_bf16_us']:.1f}")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "int4_rows_gemm.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)


if __name__ == "__main__":
    main()
