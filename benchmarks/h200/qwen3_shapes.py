"""Batch-1 projections of the Qwen3-30B-A3B shape on the H200: cuBLAS against the Triton GEMV tiles
(what runtime.batch1_gemv could route; its envelope, N and K >= 4096, leaves these on cuBLAS), and the
MoE router: linear + router kernel (two launches) against the one-launch router.

    python benchmarks/h200/qwen3_shapes.py [--out DIR]

Timings replay CUDA graphs cycling over weight copies (> 256 MB, so HBM serves them); writes
qwen3_shapes.json. About 30 s."""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gemv_vs_cublas import CONFIGS, time_graph  # noqa: E402
from radixserve.layers.triton_gemv import gemv  # noqa: E402

SHAPES = {"qkv": (5120, 2048), "o": (2048, 4096), "router_gate": (128, 2048)}  # (N, K)


def projections() -> dict:
    rows = {}
    for name, (n, k) in SHAPES.items():
        copies = max(2, -(-256 * 2**20 // (n * k * 2)))
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        want = F.linear(x, weights[0]).float()
        cublas = time_graph(lambda a, w: F.linear(a, w), weights, x)
        best = None
        for cfg in CONFIGS:
            try:
                err = ((gemv(x, weights[0], config=cfg).float() - want).norm() / want.norm()).item()
                us = time_graph(lambda a, w, c=cfg: gemv(a, w, config=c), weights, x)
            except Exception as e:  # a tile that does not fit this shape
                print(f"  {name} {cfg}: {e!r}"[:160])
                continue
            if err < 1e-2 and (best is None or us < best["us"]):
                best = {"config": cfg.__dict__, "us": round(us, 2), "rel_err": float(f"{err:.2e}")}
        floor_us = n * k * 2 / 4.25e12 * 1e6
        rows[name] = {"N": n, "K": k, "cublas_us": round(cublas, 2), "best_gemv": best, "hbm_floor_us": round(floor_us, 2)}
        print(f"{name:12s} N={n:5d} K={k:5d}  cuBLAS {cublas:6.2f} us  best GEMV {best}  floor {floor_us:.2f} us",
              flush=True)
        del weights
        torch.cuda.empty_cache()
    return rows


def router() -> dict:
    from radixserve.layers.moe import RoutingConfig, small_m

    cfg = RoutingConfig(top_k=8, scoring="softmax", renormalize=True)
    n, k = SHAPES["router_gate"]
    copies = 1024  # 0.5 MB each: 512 MB
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    arrivals = torch.zeros(64, dtype=torch.int32, device="cuda")
    two = time_graph(lambda a, w: small_m.fused_select_experts(F.linear(a, w), cfg), weights, x)
    one = time_graph(lambda a, w: small_m.fused_gate_select_experts(a, w, cfg, arrivals), weights, x)
    _, want = small_m.fused_select_experts(F.linear(x, weights[0]), cfg)
    _, got = small_m.fused_gate_select_experts(x, weights[0], cfg, arrivals)
    row = {"linear_plus_router_us": round(two, 2), "one_launch_us": round(one, 2),
           "same_experts": bool(torch.equal(want.sort(1).values, got.sort(1).values)),
           "counters_zero": not bool(arrivals.any())}
    print(f"router: linear + router {two:.2f} us, one launch {one:.2f} us, {row}", flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    torch.manual_seed(0)
    rows = {"projections": projections()}
    try:
        rows["router"] = router()
    except Exception as e:
        rows["router"] = {"error": repr(e)[:300]}
        print(f"router timing failed: {e!r}"[:300])
    with open(os.path.join(args.out, "qwen3_shapes.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
