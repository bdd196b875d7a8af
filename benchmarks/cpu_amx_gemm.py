#!/usr/bin/env python3
"""The bf16 GEMMs of runtime.cpu_matmul_precision=medium on a CPU with AMX: SmolLM2-135M's 120 decoder
weights (30 layers of qkv 960x576, o 576x576, gate_up 3072x576 with the fused SiLU, down 576x1536),
one after another as a decode or prefill step streams them, at several row counts, three ways:
- `panels`: the native kernel's bf16 panels (csrc/gemm.cpp; widened or vdpbf16ps as measured at load),
- `amx`: the AMX tile kernel (csrc/amx_gemm.cpp), what `medium` runs on such a CPU,
- `onednn`: torch's oneDNN bf16 linear on a packed bf16 weight (x cast to bf16, the result cast back),
  for scale: it uses AMX too, but its rows depend on the row count (not batch-invariant).

    python benchmarks/cpu_amx_gemm.py [ROWS ...]      # default 1 4 16 64 512

Best of 5 passes per row count and kind; prints one JSON line each with ms and GFLOP/s."""

from __future__ import annotations

import json
import platform
import subprocess
import sys
import time

import torch
from radixserve.layers import cpu_gemm

HIDDEN, INTERMEDIATE, QKV, LAYERS = 576, 1536, 960, 30


def weights(gen: torch.Generator) -> list[tuple[torch.Tensor, bool]]:
    out = []
    for _ in range(LAYERS):
        out += [(torch.randn(QKV, HIDDEN, generator=gen) * 0.05, False),
                (torch.randn(HIDDEN, HIDDEN, generator=gen) * 0.05, False),
                (torch.randn(2 * INTERMEDIATE, HIDDEN, generator=gen) * 0.05, True),
                (torch.randn(HIDDEN, INTERMEDIATE, generator=gen) * 0.05, False)]
    return out


def best_ms(fn, passes: int = 5) -> float:
    fn()  # warm-up on the same shapes (different values each pass would not change a GEMM's time)
    best = float("inf")
    for _ in range(passes):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main() -> None:
    if not cpu_gemm.amx_available():
        sys.exit("this CPU has no AMX tiles (amx_bf16 in /proc/cpuinfo) or the kernel did not build")
    torch.set_num_threads(2)
    ws = weights(torch.Generator().manual_seed(0))
    packed = [cpu_gemm.pack_silu_gated(w) if gated else cpu_gemm.pack(w) for w, gated in ws]
    kinds = {"panels": [cpu_gemm.to_bf16(p) for p in packed],
             "amx": [cpu_gemm.to_amx(p, w) for p, (w, _) in zip(packed, ws, strict=True)]}
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w.bfloat16(), 64) for w, _ in ws]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    print(json.dumps({"what": "setup", "cpu": cpu, "python": platform.python_version(), "torch": torch.__version__,
                      "commit": commit, "products": cpu_gemm.bf16_product_description()}))
    for rows in [int(a) for a in sys.argv[1:]] or (1, 4, 16, 64, 512):
        gen = torch.Generator().manual_seed(rows)
        xs = {k: torch.randn(rows, k, generator=gen) for k in (HIDDEN, INTERMEDIATE)}
        flops = sum(2 * rows * w.shape[0] * w.shape[1] for w, _ in ws)

        def run(kind: str, xs: dict[int, torch.Tensor] = xs) -> None:
            for (w, gated), p in zip(ws, kinds[kind], strict=True):
                x = xs[w.shape[1]]
                cpu_gemm.silu_gated_linear(x, p) if gated else cpu_gemm.linear(x, w, p)

        def run_onednn(xs: dict[int, torch.Tensor] = xs) -> None:
            for (w, _), p in zip(ws, onednn, strict=True):
                torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]].to(torch.bfloat16), p, None, "none", [], "").float()

        row = {"rows": rows, "weights": len(ws)}
        for name, fn in (("panels", lambda: run("panels")), ("amx", lambda: run("amx")), ("onednn", run_onednn)):
            ms = best_ms(fn)
            row[f"{name}_ms"], row[f"{name}_gflops"] = round(ms, 2), round(flops / ms / 1e6, 1)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
