"""One MoE layer on the GPU, old path vs the small-batch path (session 5, issue 16).

For Qwen3-30B-A3B (128 experts, top 8, H 2048, I 768, softmax + renormalise) and Mixtral-8x7B
(8 experts, top 2, H 4096, I 14336) in bf16, at M = 1, 2, 4, 8, 16, 32 tokens:
- correctness: the grouped-GEMM path and the small path against an fp32 torch computation, the fused
  router against `select_experts` (same ids, close weights), and a CUDA-graph replay of the small
  path against its eager result (bit-identical expected);
- time per layer call (router + experts) in CUDA-graph replay, old (torch router + grouped GEMM)
  and new (fused router + small path), plus the experts alone; the weights rotate over 4 copies so
  no call finds the previous call's weights in L2 (as in a real step, where each layer has its own);
- the HBM floor of the experts at each M (distinct active experts' bytes / the copy bandwidth
  measured here) and the fraction of it the small path reaches;
- a sweep of the small path's tile sizes and down-projection splits at M=1 (and M=8 for Qwen).

    python benchmarks/h200/s5_moe_kernels.py --out DIR [--shapes qwen3-30b-a3b mixtral-8x7b]

Writes DIR/kernel.jsonl (one row per (shape, M)), DIR/kernel_sweep.jsonl, prints progress lines;
exits 1 when a correctness check fails."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import torch
from radixserve.layers.moe import RoutingConfig, select_experts
from radixserve.layers.moe.cpu import cpu_fused_experts
from radixserve.layers.moe.small_m import (
    DEFAULT_BLOCKS,
    SMALL_M_MAX_PAIRS,
    down_splits,
    fused_select_experts,
    small_m_fused_experts,
    use_small_m,
)
from radixserve.layers.moe.triton_kernel import triton_fused_experts

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from moe_limit import hbm_bandwidth  # noqa: E402

SHAPES = {"qwen3-30b-a3b": (128, 8, 2048, 768), "mixtral-8x7b": (8, 2, 4096, 14336)}
COPIES = 4


def graph_us(fn, calls: int = 8, replays: int = 20) -> float:
    """Microseconds per fn(j) call, j = 0..calls-1, replayed from one CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for j in range(3):
            fn(j)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for j in range(calls):
            fn(j)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (replays * calls)


def replay_matches_eager(fn) -> bool:
    eager = fn().clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    return bool(torch.equal(out, eager))


def emit(path: str, row: dict, hide: tuple[str, ...] = ()) -> None:
    """Append row to path; print it without the `hide` keys."""
    print(json.dumps({k: v for k, v in row.items() if k not in hide}), flush=True)
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES))
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    rows_path, sweep_path = os.path.join(args.out, "kernel.jsonl"), os.path.join(args.out, "kernel_sweep.jsonl")
    bw = hbm_bandwidth()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s, {sms} SMs, SMALL_M_MAX_PAIRS={SMALL_M_MAX_PAIRS}, "
          f"blocks {DEFAULT_BLOCKS}", flush=True)
    ok = True
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name in args.shapes:
        e, k, h, i = SHAPES[name]
        cfg = RoutingConfig(top_k=k, scoring="softmax", renormalize=True)
        t0 = time.time()
        w13 = [torch.randn(e, 2 * i, h, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.02 for _ in range(COPIES)]
        w2 = [torch.randn(e, h, i, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.02 for _ in range(COPIES)]
        w13f, w2f = w13[0].float(), w2[0].float()
        print(f"[{name}] weights ready ({time.time() - t0:.1f} s); splits at this shape: "
              f"{down_splits(k, h, i, sms)}", flush=True)
        expert_bytes = 3 * h * i * 2
        for m in args.tokens:
            x = torch.randn(m, h, device="cuda", generator=gen, dtype=torch.bfloat16)
            logits = torch.randn(m, e, device="cuda", generator=gen)  # fp32: no exact ties for top-k to break
            weights, ids = select_experts(logits, cfg)
            fw, fids = fused_select_experts(logits, cfg)
            router_ok = bool(torch.equal(fids, ids)) and bool(torch.allclose(fw, weights, atol=1e-5, rtol=1e-4))
            want = cpu_fused_experts(x.float(), w13f, w2f, weights, ids)
            scale = want.abs().max().item()
            err = {}
            for path in ("grouped", "small"):
                got = triton_fused_experts(x, w13[0], w2[0], weights, ids, path=path).float()
                err[path] = round((got - want).abs().max().item() / scale, 5)
            graph_ok = replay_matches_eager(lambda: triton_fused_experts(x, w13[0], w2[0], weights, ids,  # noqa: B023
                                                                         path="small"))
            deterministic = bool(torch.equal(triton_fused_experts(x, w13[0], w2[0], weights, ids, path="small"),
                                             triton_fused_experts(x, w13[0], w2[0], weights, ids, path="small")))

            def old_layer(j):
                wt, it = select_experts(logits, cfg)  # noqa: B023
                return triton_fused_experts(x, w13[j % COPIES], w2[j % COPIES], wt, it, path="grouped")  # noqa: B023

            def new_layer(j):
                wt, it = fused_select_experts(logits, cfg)  # noqa: B023
                return triton_fused_experts(x, w13[j % COPIES], w2[j % COPIES], wt, it, path="small")  # noqa: B023

            def old_experts(j):
                return triton_fused_experts(x, w13[j % COPIES], w2[j % COPIES], weights, ids, path="grouped")  # noqa: B023

            def new_experts(j):
                return triton_fused_experts(x, w13[j % COPIES], w2[j % COPIES], weights, ids, path="small")  # noqa: B023

            us = {fn.__name__: round(graph_us(fn), 2) for fn in (old_layer, new_layer, old_experts, new_experts)}
            distinct = int(torch.unique(ids).numel())
            floor_us = distinct * expert_bytes / bw * 1e6
            good = router_ok and graph_ok and deterministic and max(err.values()) < 2e-2
            ok &= good
            emit(rows_path, {
                "shape": name, "tokens": m, "pairs": m * k, "distinct_experts": distinct,
                "auto_path": "small" if use_small_m(m * k, e) else "grouped",
                "max_rel_err": err, "router_ids_equal_weights_close": router_ok,
                "small_graph_replay_equals_eager": graph_ok, "small_deterministic": deterministic,
                "graph_us": us, "speedup_layer": round(us["old_layer"] / us["new_layer"], 2),
                "experts_hbm_floor_us": round(floor_us, 2),
                "small_experts_fraction_of_floor": round(floor_us / us["new_experts"], 3),
                "small_experts_GB_s": round(distinct * expert_bytes / us["new_experts"] / 1e3, 1), "ok": good,
            })
        # tile-size and split sweep of the small path (experts only)
        blocks = [DEFAULT_BLOCKS,
                  dataclasses.replace(DEFAULT_BLOCKS, gate_up_n=32, gate_up_k=128),
                  dataclasses.replace(DEFAULT_BLOCKS, gate_up_n=8, gate_up_k=512),
                  dataclasses.replace(DEFAULT_BLOCKS, gate_up_n=16, gate_up_k=128),
                  dataclasses.replace(DEFAULT_BLOCKS, num_warps=8),
                  dataclasses.replace(DEFAULT_BLOCKS, down_n=16, down_k=256),
                  dataclasses.replace(DEFAULT_BLOCKS, down_n=64, down_k=128)]
        split_choices = (1, 2, 3) if i <= 1024 else (1, 3, 7)
        for m in ((1, 8) if k >= 8 else (1,)):
            x = torch.randn(m, h, device="cuda", generator=gen, dtype=torch.bfloat16)
            weights, ids = select_experts(torch.randn(m, e, device="cuda", generator=gen), cfg)
            want = cpu_fused_experts(x.float(), w13f, w2f, weights, ids)
            results = []
            for b in blocks:
                for s in split_choices:
                    got = small_m_fused_experts(x, w13[0], w2[0], weights, ids, splits=s, blocks=b).float()
                    err = (got - want).abs().max().item() / want.abs().max().item()
                    us = graph_us(lambda j: small_m_fused_experts(x, w13[j % COPIES], w2[j % COPIES],  # noqa: B023
                                                                  weights, ids, splits=s, blocks=b))  # noqa: B023
                    results.append({"blocks": dataclasses.asdict(b), "splits": s, "us": round(us, 2),
                                    "max_rel_err": round(err, 5)})
                    ok &= err < 2e-2
            results.sort(key=lambda r: r["us"])
            emit(sweep_path, {"shape": name, "tokens": m, "default": dataclasses.asdict(DEFAULT_BLOCKS),
                              "default_splits": down_splits(k, h, i, sms), "best": results[:3],
                              "all": results}, hide=("all",))
        w13 = w2 = w13f = w2f = None  # free this shape before the next
        torch.cuda.empty_cache()
    print("kernel check", "ok" if ok else "FAILED", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
