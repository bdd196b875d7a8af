#!/usr/bin/env python3
"""Cross-compile the batch-1 decode kernels for sm_90 on this CPU machine (no GPU) and report what the
compiler made of them: registers and spill stack per thread, shared memory, SASS size, and the
instructions a change is usually about (PDL's PREEXIT / ACQBULK, L2 prefetches, global loads, local
spill traffic). Triton's wheel carries ptxas and cuobjdump, so this runs wherever Triton is installed.

    python benchmarks/sm90_kernel_report.py                 # every preset below
    python benchmarks/sm90_kernel_report.py router experts  # presets whose name contains one of these
    python benchmarks/sm90_kernel_report.py --sass DIR      # also write each kernel's SASS there

Why: device time is scarce (30 minutes a session, often none); a kernel edit can be checked for
compile errors, register growth (programs per SM) and instruction order (is the load really before
the PDL wait?) before a device call. Timings still need the GPU. Pointer and stride arguments are
marked divisible by 16, as Triton's launcher specialises them at run time: without that the compiler
emits scalar loads and different register counts than the GPU build has.

Presets: the Qwen3-30B-A3B shape's one-launch router and experts kernels (small_m / one_launch), the
triton backend's decode split kernel and rotary + KV store kernel (Llama / Qwen3 head_dim 128, GQA 8),
the batch-1 GEMV and RMSNorm + GEMV tiles (Llama-3.1-8B shapes), each with and without its PDL
constexprs."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field

os.environ.pop("TRITON_INTERPRET", None)  # compile, do not interpret


@dataclass
class Preset:
    name: str
    kernel: object  # a @triton.jit function
    signature: dict[str, str]  # non-constexpr argument -> Triton type ("*bf16", "i32", "fp32", ...)
    constexprs: dict[str, object]
    num_warps: int = 4
    num_stages: int = 3
    divisible: set[str] = field(default_factory=set)  # int arguments known to be multiples of 16


def presets() -> list[Preset]:
    """The kernels and shapes reported by default (imports the core's and the triton plugin's kernels)."""
    from radixserve.layers.moe import one_launch, small_m
    from radixserve_attention_triton import decode_kernel, rotary_store_kernel

    out = []
    router = small_m._kernels(False).gate_router
    router_sig = dict(x_ptr="*bf16", w_ptr="*bf16", logits_ptr="*fp32", bias_ptr="*fp32", weights_ptr="*fp32",
                      ids_ptr="*i32", arrivals_ptr="*i32", E="i32", stride_xm="i32", stride_we="i32", scale="fp32",
                      res_ptr="*bf16", norm_w_ptr="*bf16", xn_ptr="*bf16", res_out_ptr="*bf16", stride_rm="i32",
                      eps="fp32")
    for gdc, trigger in ((False, False), (True, False), (True, True)):
        out.append(Preset(f"router_qwen3_gdc{int(gdc)}_trigger{int(trigger)}", router, router_sig,
                          dict(K=2048, TOP_K=8, SIGMOID=False, RENORMALIZE=True, HAS_BIAS=False, ROWS=small_m.GATE_ROWS,
                               BLOCK_K=1024, BLOCK_E=128, BLOCK_TOPK=8, NORM=True, PRELOAD=True, GDC=gdc,
                               TRIGGER=trigger), num_warps=1, divisible={"E"}))
    experts = one_launch._kernels(False).experts
    experts_sig = {a: "*bf16" for a in ("x_ptr", "w13_ptr", "w2_ptr", "final_ptr")}
    experts_sig.update({a: "*fp32" for a in ("act_ptr", "partial_ptr", "weight_ptr")})
    experts_sig.update(ids_ptr="*i32", sync_ptr="*i32")
    experts_sig.update({a: "i32" for a in ("INTER", "top_k", "stride_xm", "stride_13e", "stride_13n", "stride_2e",
                                           "stride_2n", "PAIRS", "GU_BLOCKS", "DN_BLOCKS", "SPLITS")})
    b = small_m.DEFAULT_BLOCKS
    for gdc in (False, True):
        out.append(Preset(f"experts_qwen3_gdc{int(gdc)}", experts, experts_sig,
                          dict(H=2048, k_per_split=768, ROWS=8, GU_N=b.gate_up_n, GU_K=b.gate_up_k, DN_N=b.down_n,
                               DN_K=b.down_k, EVEN_GU_K=True, EVEN_DN_K=True, BLOCK_P=64, TRIGGER=True, GDC=gdc),
                          num_warps=b.num_warps, divisible={"INTER"}))
    split = decode_kernel._decode_stage1_kernel
    split_sig = {a: "i32" for a in split.arg_names if a.startswith("stride") or a == "window"}
    split_sig.update(Q="*bf16", K_buf="*bf16", V_buf="*bf16", ReqToToken="*i32", req_pool_idx_ptr="*i64",
                     seq_lens_ptr="*i64", num_splits_ptr="*i32", MidO="*fp32", MidLse="*fp32", sm_scale="fp32",
                     v_scale="fp32", logit_cap="fp32")
    cfg = decode_kernel.decode_config(128, False)
    for gdc, trigger in ((False, False), (True, False), (True, True)):
        out.append(Preset(f"decode_split_d128_gqa8_gdc{int(gdc)}_trigger{int(trigger)}", split, split_sig,
                          dict(GROUP=8, HEAD_DIM=128, BLOCK_D=128, BLOCK_H=16, BLOCK_N=cfg.block_n, BLOCK_S=32,
                               HAS_CAP=False, HAS_WINDOW=False, KV_FP8=False, IEEE=False, GDC=gdc, TRIGGER=trigger),
                          num_warps=cfg.num_warps, num_stages=cfg.num_stages))
    merge = decode_kernel._decode_stage2_kernel
    merge_sig = {a: "i32" for a in merge.arg_names if a.startswith("stride")}
    merge_sig.update(MidO="*fp32", MidLse="*fp32", Out="*bf16", num_splits_ptr="*i32")
    for gdc in (False, True):
        out.append(Preset(f"decode_merge_d128_gdc{int(gdc)}", merge, merge_sig,
                          dict(HEAD_DIM=128, BLOCK_D=128, BLOCK_S=32, TRIGGER=True, GDC=gdc)))
    from radixserve.layers import norm_gemv, triton_gemv

    gemv_cfg = triton_gemv.default_config(4096, 4096, False)
    gemv = triton_gemv._kernels(False).gemv
    for pdl in (False, True):  # the 8B o projection's shape, a PDL tile or not (runtime.batch1_gemv_pdl)
        out.append(Preset(f"gemv_8b_o_pdl{int(pdl)}", gemv,
                          dict(X="*bf16", W="*bf16", B="*bf16", Y="*bf16", N="i32", K="i32", stride_wn="i32"),
                          dict(HAS_BIAS=False, BLOCK_N=gemv_cfg.block_n, BLOCK_K=gemv_cfg.block_k, EVEN_K=True,
                               GATED=False, PDL=pdl, GDC=pdl),
                          num_warps=gemv_cfg.num_warps, num_stages=gemv_cfg.num_stages, divisible={"N", "K"}))
    out.append(Preset("rmsnorm_gemv_8b_qkv_pdl1", norm_gemv._kernels(False).rmsnorm_gemv,
                      dict(X="*bf16", R="*bf16", G="*bf16", W="*bf16", B="*bf16", Y="*bf16", ResOut="*bf16", N="i32",
                           K="i32", stride_wn="i32", eps="fp32"),
                      dict(HAS_RESIDUAL=True, HAS_BIAS=False, BLOCK_N=gemv_cfg.block_n, BLOCK_K=gemv_cfg.block_k,
                           EVEN_K=True, RES_BLOCK=1024, PDL=True, GDC=True),
                      num_warps=gemv_cfg.num_warps, num_stages=gemv_cfg.num_stages, divisible={"N", "K"}))
    store = rotary_store_kernel._rotary_store_kernel
    store_sig = {a: "i32" for a in store.arg_names if a.startswith("stride")}
    store_sig.update({a: "*bf16" for a in ("Q", "K", "V", "QO", "K_buf", "V_buf", "QW", "KW")})
    store_sig.update(Loc="*i64", C="*fp32", S="*fp32", P="*i64", eps="fp32")
    for gdc in (False, True):
        out.append(Preset(f"rotary_store_qwen3_trigger1_gdc{int(gdc)}", store, store_sig,
                          dict(NQ=32, NK=4, HEAD_DIM=128, HALF=64, HALF_BLOCK=64, REST=0, REST_BLOCK=1, D_BLOCK=128,
                               BLOCK_H=8, HAS_NORM=True, TRIGGER=True, GDC=gdc)))
    return out


# instruction classes worth counting in a report (SASS mnemonics)
WATCH = {"PREEXIT": r"\bPREEXIT\b", "ACQBULK": r"\bACQBULK\b", "L2 prefetch": r"\bCCTL\.E\.PF2\b",
         "global loads": r"\bLDG\.", "spill loads": r"\bLDL\b", "spill stores": r"\bSTL\b"}


def compile_report(p: Preset, sass_dir: str | None = None) -> dict:
    """Compile one preset for sm_90: its resource use, counts of the WATCH instructions, and the
    SASS text ("sass"). Raises whatever Triton or cuobjdump raise (no ptxas in this Triton, say)."""
    import triton
    from triton.backends.compiler import GPUTarget

    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(p.kernel.arg_names)
             if a in p.signature and (p.signature[a].startswith("*") or a.startswith("stride") or a in p.divisible)}
    sig = {a: p.signature.get(a, "constexpr") for a in p.kernel.arg_names}
    src = triton.compiler.ASTSource(fn=p.kernel, signature=sig, constexprs=p.constexprs, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": p.num_warps, "num_stages": p.num_stages})
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=True).stdout
        usage = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+)", usage)
    lines = [ln for ln in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4,}\*/", ln)]
    row = {"kernel": p.name, "registers": int(m.group(1)), "spill_stack_bytes": int(m.group(2)),
           # static (cuobjdump) or Triton's dynamic shared memory: a pipelined loop's stages live in the latter
           "shared_bytes": max(int(m.group(3)), int(compiled.metadata.shared)), "sass_instructions": len(lines),
           **{k: sum(bool(re.search(rx, ln)) for ln in lines) for k, rx in WATCH.items()}}
    # programs an SM can hold by registers alone (65,536 a SM; allocation in warps of 32 threads), and by shared
    # memory (sm_90: 228 KB an SM, 1 KB of it reserved per program)
    row["programs_per_sm_by_registers"] = 65536 // max(1, row["registers"] * 32 * p.num_warps)
    row["programs_per_sm_by_shared"] = 228 * 1024 // (row["shared_bytes"] + 1024)
    row["sass"] = sass  # dropped from the printed report
    if sass_dir:
        os.makedirs(sass_dir, exist_ok=True)
        with open(os.path.join(sass_dir, p.name + ".sass"), "w") as f:
            f.write(sass)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("names", nargs="*", help="report only presets whose name contains one of these")
    ap.add_argument("--sass", default=None, metavar="DIR", help="write each kernel's SASS to DIR/<preset>.sass")
    args = ap.parse_args()
    try:
        every = presets()
    except ImportError as e:
        print(f"sm90_kernel_report: {e} (install the project with its triton plugin, and Triton)", file=sys.stderr)
        return 2
    chosen = [p for p in every if not args.names or any(n in p.name for n in args.names)]
    if not chosen:
        print(f"sm90_kernel_report: no preset matches {args.names}; presets: {', '.join(p.name for p in every)}",
              file=sys.stderr)
        return 2
    import json

    for p in chosen:
        row = compile_report(p, args.sass)
        row.pop("sass")
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
