"""Issue 18 (Llama-3.1-8B batch-1 decode): the RMSNorm fused into the batch-1 GEMV after it
(radixserve.layers.norm_gemv, `runtime.batch1_gemv_fuse_norm`) against the two kernels it replaces.

    python3 benchmarks/h200/fused_norm_gemv.py --out $OUT [--parts shapes,engine[,profile]]

Parts (each prints progress lines; results in $OUT/fused_norm_gemv.json):
- shapes: per 8B shape (qkv 6144x4096 after the input norm, gate_up 28672x4096 after the
  post-attention norm) microseconds per call, replayed from a CUDA graph that cycles over enough
  weight copies (> 256 MB) to stream every weight from HBM: residual-add+RMSNorm kernel then the
  GEMV (today's path, auto's tile) vs the fused kernel with auto's tile (`--sweep`: and a few
  alternates); and
  closeness: fused vs the two-kernel output (bit-equal fraction, relative error) and vs an fp32
  reference, the residual stream bit-equal.
  Then the down projection: silu_and_mul + GEMV against the gated GEMV over a few tiles (~15 s).
- engine: Engine batch-1 decode (1024 in / 512 out, dummy weights, triton attention, CUDA graphs)
  with runtime.batch1_gemv_fuse_norm=false, true, then true with runtime.batch1_gemv_fuse_silu=true
  (benchmarks/offline_throughput.py as in s6_gemv2.sh); needs the tokenizer in .gpu2/tok-smollm2
  (carry .gpu2).
- profile: benchmarks/h200/profile_decode.py --variants rotary+gemv,rotary+gemv+norm (graph replay ms
  per step with the fusion off / on, top kernels; ~2 min, not in the default parts).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

SHAPES = {"qkv": (6144, 4096), "gate_up": (28672, 4096)}  # (N, K) of Llama-3.1-8B, K = hidden
EPS = 1e-5
T0 = time.time()
SWEEP = False  # --sweep: the fused kernel over alternate tiles too


def log(msg: str) -> None:
    print(f"[fused_norm_gemv {time.time() - T0:6.1f}s] {msg}", flush=True)


def time_graph(fn, weights: list[torch.Tensor], reps: int = 20) -> float:
    """Microseconds per call of fn(w), w cycling over `weights`, replayed from one CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for w in weights:  # warm-up: compile
            fn(w)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w in weights:
            fn(w)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / reps / len(weights)


def timings(name: str, weights: list[torch.Tensor], x: torch.Tensor, g: torch.Tensor, r: torch.Tensor,
            tile) -> dict:
    """Graph-replayed microseconds per call: the norm, the GEMV, both, the fused kernel (auto's tile,
    with and without the residual add, then alternates)."""
    from radixserve.layers import triton_ops
    from radixserve.layers.norm_gemv import rmsnorm_gemv
    from radixserve.layers.triton_gemv import GemvConfig, gemv

    row = {}
    row["norm_us"] = round(time_graph(lambda w: triton_ops.rmsnorm(x, g, EPS, r), weights), 2)
    row["gemv_us"] = round(time_graph(lambda w: gemv(x, w, config=tile), weights), 2)
    row["norm_then_gemv_us"] = round(time_graph(lambda w: gemv(triton_ops.rmsnorm(x, g, EPS, r)[0], w, config=tile),
                                                weights), 2)
    row["fused_us"] = round(time_graph(lambda w: rmsnorm_gemv(x, g, EPS, w, None, r, tile), weights), 2)
    row["fused_first_layer_us"] = round(time_graph(lambda w: rmsnorm_gemv(x, g, EPS, w, None, None, tile), weights), 2)
    log(f"{name} tile {tile.__dict__}: norm {row['norm_us']} us, GEMV {row['gemv_us']} us, "
        f"norm+GEMV {row['norm_then_gemv_us']} us, fused {row['fused_us']} us (no residual: "
        f"{row['fused_first_layer_us']} us)")
    alternates = {}
    for alt in [] if not SWEEP else [GemvConfig(8, 512, 4, 3), GemvConfig(16, 256, 4, 4), GemvConfig(16, 512, 4, 3),
                GemvConfig(8, 1024, 4, 2), GemvConfig(16, 1024, 8, 2), GemvConfig(4, 1024, 4, 3)]:
        if alt == tile:
            continue
        try:
            us = round(time_graph(lambda w, c=alt: rmsnorm_gemv(x, g, EPS, w, None, r, c), weights), 2)
        except Exception as e:  # a tile that does not compile is a finding, not the end of the run
            alternates[str(alt.__dict__)] = repr(e)[:120]
            continue
        alternates[str(alt.__dict__)] = us
        log(f"    fused with {alt.__dict__}: {us} us")
    row["fused_alternates_us"] = alternates
    return row


def shapes_part() -> dict:
    from radixserve.layers import triton_ops
    from radixserve.layers.gemv_selection import gemv_config_for_shape
    from radixserve.layers.norm_gemv import rmsnorm_gemv
    from radixserve.layers.triton_gemv import gemv

    rows = {}
    for name, (n, k) in SHAPES.items():
        tile = gemv_config_for_shape(n, k)
        copies = max(2, -(-256 * 2**20 // (n * k * 2)))
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5 for _ in range(copies)]
        g = (1 + 0.1 * torch.randn(k, device="cuda")).to(torch.bfloat16)
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        r = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)

        # closeness over a few activations
        bit_eq, rel_two, rel_fused_ref, rel_two_ref, res_equal = [], 0.0, 0.0, 0.0, True
        for trial in range(8):
            xt = torch.randn(1, k, device="cuda", dtype=torch.bfloat16) * (1 + trial)
            rt = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
            w = weights[trial % copies]
            h, s_two = triton_ops.rmsnorm(xt, g, EPS, rt)
            two = gemv(h, w, config=tile)
            fused, s_fused = rmsnorm_gemv(xt, g, EPS, w, None, rt, tile)
            s32 = (xt.float() + rt.float()).to(torch.bfloat16).float()
            ref = F.linear(s32 * torch.rsqrt(s32.pow(2).mean(-1, keepdim=True) + EPS) * g.float(), w.float())
            bit_eq.append((two == fused).float().mean().item())
            rel_two = max(rel_two, ((fused.float() - two.float()).norm() / two.float().norm()).item())
            rel_fused_ref = max(rel_fused_ref, ((fused.float() - ref).norm() / ref.norm()).item())
            rel_two_ref = max(rel_two_ref, ((two.float() - ref).norm() / ref.norm()).item())
            res_equal &= torch.equal(s_two, s_fused)
        row = {"N": n, "K": k, "tile": tile.__dict__, "bit_equal_frac_vs_two_kernels": round(sum(bit_eq) / len(bit_eq), 4),
               "rel_err_vs_two_kernels": float(f"{rel_two:.2e}"), "rel_err_fused_vs_fp32": float(f"{rel_fused_ref:.2e}"),
               "rel_err_two_kernels_vs_fp32": float(f"{rel_two_ref:.2e}"), "residual_bit_equal": res_equal}
        log(f"{name}: fused vs two kernels bit-equal {row['bit_equal_frac_vs_two_kernels']:.3f}, rel {rel_two:.2e}; "
            f"vs fp32: fused {rel_fused_ref:.2e}, two kernels {rel_two_ref:.2e}; residual equal {res_equal}")

        row.update(timings(name, weights, x, g, r, tile))
        rows[name] = row
        del weights
        torch.cuda.empty_cache()
    per_step = 32 * sum(r["norm_then_gemv_us"] - r["fused_us"] for r in rows.values()) / 1e3
    rows["per_step_saving_ms_32_layers"] = round(per_step, 3)
    log(f"per 32-layer step: {per_step:.3f} ms saved by the fusion (qkv + gate_up, from these timings)")
    return rows


def gated_down_part() -> dict:
    """The 8B down projection (4096 x 14336) after silu_and_mul: two launches (auto's tile) against the
    gated GEMV (silu_and_mul in its prologue) over a few tiles. Session 6 measured the gated GEMV on
    auto's 16x1024 / 8-warp tile slower (37.4 vs 30.8 us); offline ptxas for sm90 gives that tile 161
    registers gated vs 128 plain (1 program of 8 warps per SM instead of 2), the smaller tiles here
    79-93."""
    from radixserve.layers import triton_ops
    from radixserve.layers.gemv_selection import gemv_config_for_shape
    from radixserve.layers.triton_gemv import GemvConfig, gemv

    n, k = 4096, 14336
    tile = gemv_config_for_shape(n, k)
    copies = max(2, -(-256 * 2**20 // (n * k * 2)))
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5 for _ in range(copies)]
    gu = torch.randn(1, 2 * k, device="cuda", dtype=torch.bfloat16)
    row = {"tile": tile.__dict__, "silu_and_mul_then_gemv_us": round(
        time_graph(lambda w: gemv(triton_ops.silu_and_mul(gu), w, config=tile), weights), 2), "gated_us": {}}
    log(f"down: silu_and_mul + GEMV {tile.__dict__}: {row['silu_and_mul_then_gemv_us']} us")
    for cfg in [tile, GemvConfig(16, 512, 8, 2), GemvConfig(8, 1024, 8, 2), GemvConfig(8, 512, 4, 3),
                GemvConfig(4, 1024, 4, 3)]:
        same = torch.equal(gemv(gu, weights[0], config=cfg, gated=True),
                           gemv(triton_ops.silu_and_mul(gu), weights[0], config=cfg))
        us = round(time_graph(lambda w, c=cfg: gemv(gu, w, config=c, gated=True), weights), 2)
        row["gated_us"][str(cfg.__dict__)] = {"us": us, "bit_equal_to_two_launches": same}
        log(f"    gated GEMV {cfg.__dict__}: {us} us (bit-equal to silu_and_mul + same tile: {same})")
    del weights
    torch.cuda.empty_cache()
    return row


def engine_part(out: str) -> dict:
    rows = {}
    base = ["runtime.device=cuda", "runtime.dtype=bfloat16", "stack.attention=triton", "runtime.cuda_graph_max_bs=8",
            "scheduler.max_running_requests=8"]
    variants = {"off": ["runtime.batch1_gemv_fuse_norm=false"], "norm": ["runtime.batch1_gemv_fuse_norm=true"],
                "norm+silu": ["runtime.batch1_gemv_fuse_norm=true", "runtime.batch1_gemv_fuse_silu=true"]}
    for fuse, flags in variants.items():
        log(f"engine batch-1, {' '.join(flags)}")
        path = os.path.join(out, f"batch1_engine_{fuse}.jsonl")
        cmd = [sys.executable, "benchmarks/offline_throughput.py", "--model", "benchmarks/model-configs/llama-3.1-8b",
               "--load-format", "dummy", "--tokenizer", ".gpu2/tok-smollm2", "--num-prompts", "1", "--input-len", "1024",
               "--output-len", "512", "--result-file", path, *base, *flags]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=80)
        except subprocess.TimeoutExpired:
            log("    timed out (80 s)")
            rows[fuse] = {"error": "timeout"}
            continue
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("{")), None)
        if line is None:
            log(f"    failed rc={proc.returncode}: {proc.stderr[-600:]}")
            rows[fuse] = {"error": proc.stderr[-600:]}
            continue
        res = json.loads(line)
        routed = [ln for ln in proc.stderr.splitlines() if "fuse_norm=" in ln]  # the runner's log line
        rows[fuse] = {"output_tok_s": res["output_tok_s"], "seconds": res["seconds"], "runner_log": routed[-1:]}
        if routed:
            log(f"    {routed[-1][-110:]}")
        log(f"    output {res['output_tok_s']} tok/s ({res['seconds']} s)")
    return rows


def profile_part(out: str) -> None:
    log("profile: rotary+gemv vs rotary+gemv+norm")
    cmd = [sys.executable, "benchmarks/h200/profile_decode.py", "--out", out, "--variants", "rotary+gemv,rotary+gemv+norm"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=150)
        lines = [ln for ln in proc.stdout.splitlines() if "graph replay" in ln or "greedy" in ln or "ms " in ln]
        for ln in lines[:50]:
            print(ln, flush=True)
        if proc.returncode:
            log(f"    rc={proc.returncode}: {proc.stderr[-600:]}")
    except subprocess.TimeoutExpired:
        log("    profile timed out (150 s)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--parts", default="shapes,engine", help="comma-separated of shapes, engine, profile")
    ap.add_argument("--sweep", action="store_true", help="time the fused kernel over alternate tiles too")
    args = ap.parse_args()
    global SWEEP
    SWEEP = args.sweep
    parts = args.parts.split(",")
    torch.manual_seed(0)
    result: dict = {"device": torch.cuda.get_device_name()}
    path = os.path.join(args.out, "fused_norm_gemv.json")
    if "shapes" in parts:
        result["shapes"] = shapes_part()
        result["gated_down"] = gated_down_part()
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
    if "engine" in parts:
        result["engine"] = engine_part(args.out)
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
    if "profile" in parts:
        profile_part(args.out)
    log("done")


if __name__ == "__main__":
    main()
