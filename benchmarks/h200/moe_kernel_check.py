"""The fused-MoE Triton kernel on the GPU: agreement with a torch reference, and its time.

Shapes of Qwen3-30B-A3B (128 experts, top 8, H 2048, I 768) and Mixtral-8x7B (8 experts, top 2,
H 4096, I 14336) at 1, 64 and 1024 tokens, bf16. The reference is the per-expert torch path
(radixserve.layers.moe.cpu.cpu_fused_experts: torch matmuls on CUDA tensors) in fp32. For one
token the kernel's weight bandwidth (bytes of the top_k experts / time) is printed too.

    python benchmarks/h200/moe_kernel_check.py [--result-file F]

One JSON line per case; exits 1 when any case disagrees beyond bf16 tolerance."""

from __future__ import annotations

import argparse
import json

import torch
from radixserve.layers.moe import RoutingConfig, select_experts
from radixserve.layers.moe.cpu import cpu_fused_experts
from radixserve.layers.moe.triton_kernel import triton_fused_experts

SHAPES = {"qwen3-30b-a3b": (128, 8, 2048, 768), "mixtral-8x7b": (8, 2, 4096, 14336)}


def bench(fn, iters: int = 20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--result-file")
    args = ap.parse_args()
    ok = True
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name, (e, k, h, i) in SHAPES.items():
        w13 = torch.randn(e, 2 * i, h, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.02
        w2 = torch.randn(e, h, i, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.02
        for t in (1, 64, 1024):
            x = torch.randn(t, h, device="cuda", generator=gen, dtype=torch.bfloat16)
            weights, ids = select_experts(torch.randn(t, e, device="cuda", generator=gen), RoutingConfig(top_k=k))
            got = triton_fused_experts(x, w13, w2, weights, ids).float()
            want = cpu_fused_experts(x.float(), w13.float(), w2.float(), weights, ids)
            err = ((got - want).abs().max() / want.abs().max()).item()
            ms = bench(lambda: triton_fused_experts(x, w13, w2, weights, ids))  # noqa: B023
            torch_ms = bench(lambda: cpu_fused_experts(x, w13, w2, weights, ids), iters=5)  # noqa: B023
            row = {"shape": name, "tokens": t, "experts": e, "top_k": k, "hidden": h, "intermediate": i,
                   "max_rel_err_vs_fp32_torch": round(err, 5), "triton_ms": round(ms, 4),
                   "torch_per_expert_ms": round(torch_ms, 4)}
            if t == 1:
                active = k * 3 * h * i * 2
                row["weight_GB_s"] = round(active / (ms / 1e3) / 1e9, 1)
            good = err < 2e-2
            row["ok"] = good
            ok &= good
            line = json.dumps(row)
            print(line, flush=True)
            if args.result_file:
                with open(args.result_file, "a") as f:
                    f.write(line + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
