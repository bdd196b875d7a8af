"""Compile the low-bit GEMV kernels (radixserve.layers.lowbit_gemv) and the int4 tensor-core GEMM
(radixserve.layers.int4_rows_gemm) for sm_90 on a machine without a GPU and print the instruction mix of
each kernel's K loop: a CPU-side check of the unpacking cost per
weight element before spending device time (Triton's bundled ptxas/cuobjdump do the work).

    python benchmarks/lowbit_sass.py                  # the default configs
    python benchmarks/lowbit_sass.py int4 32 8 1 4     # block_n, chunks per step, M rows, warps
    python benchmarks/lowbit_sass.py planes 128 32 4 3   # GEMM variant, block_n, block_m, warps, stages

"loop" is the longest backward branch's body; "per element" divides it by the weight elements one
thread handles per iteration (int4: 8 per int32; the GEMM: one 128-column chunk of block_n rows)."""

from __future__ import annotations

import collections
import os
import re
import subprocess
import sys

os.environ.pop("TRITON_INTERPRET", None)
import triton  # noqa: E402
from radixserve.layers import int4_rows_gemm as rg  # noqa: E402
from radixserve.layers import lowbit_gemv as lg  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
DIVISIBLE = {"X", "C", "S", "Z", "GI", "Y", "W", "N", "K", "KW", "G", "stride_xm", "stride_wn"}  # as the JIT specializes


def compile_kernel(fn, sig, consts, num_warps, num_stages=1):
    names = list(sig)
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in DIVISIBLE if a in names}
    src = ASTSource(fn=fn, signature={**sig, **{k: "constexpr" for k in consts}}, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps,
                                                                        "num_stages": num_stages})


def loop_mix(cubin: bytes) -> collections.Counter:
    path = "/tmp/lowbit_sass.cubin"
    with open(path, "wb") as f:
        f.write(cubin)
    sass = subprocess.run([os.path.join(BIN, "cuobjdump"), "-sass", path], capture_output=True, text=True).stdout
    ins = [(int(m.group(1), 16), m.group(3), m.group(4)) for m in
           (re.match(r"\s+/\*([0-9a-f]+)\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_.]+)(.*?);", ln) for ln in sass.splitlines()) if m]
    back = [(int(t.group(1), 16), a) for a, op, rest in ins if op.startswith("BRA")
            for t in [re.search(r"0x([0-9a-f]+)", rest)] if t and int(t.group(1), 16) < a]
    lo, hi = max(back, key=lambda b: b[1] - b[0])
    return collections.Counter(op.split(".")[0] for a, op, _ in ins if lo <= a <= hi)


def int4(block_n, chunks, rows, warps, splits=1):
    sig = {n: t for n, t in zip(
        ["X", "C", "S", "Z", "GI", "Y", "WS", "CNT", "M", "N", "K", "KW", "G", "stride_xm", "MG8", "MG12", "MG16",
         "COLS_PER_SPLIT"],
        ["*bf16", "*i32", "*bf16", "*bf16", "*i32", "*bf16", "*fp32", "*i32"] + ["i32"] * 10)}
    consts = {"SPLITS": splits, "BLOCK_N": block_n, "CH": chunks, "PG": 8, "GS": 128, "ROWS_M": rows,
              "PLANE_": lg.PLANE}
    mix = loop_mix(compile_kernel(lg._kernels(False).int4, sig, consts, warps).asm["cubin"])
    per_thread = block_n * chunks * lg.CHUNK // (warps * 32)
    return mix, per_thread


def int4_gemm(variant, block_n, block_m, warps, stages):
    """The tensor-core GEMM over the row layout (radixserve.layers.int4_rows_gemm), one chunk per loop step."""
    sig = {n: t for n, t in zip(
        ["X", "C", "S", "Z", "Y", "WS", "CNT", "M", "N", "K", "KW", "G", "stride_xm", "MG", "CHUNKS_PER_SPLIT", "SPLITS"],
        ["*bf16", "*i32", "*bf16", "*bf16", "*bf16", "*fp32", "*i32"] + ["i32"] * 9)}
    consts = {"REDUCE_HERE": False, "BLOCK_N": block_n, "BLOCK_M": block_m, "PG": 8, "GS": 128,
              "PLANE_": lg.PLANE, "CK": lg.CHUNK, "PREFETCH": stages == 1, "ONE_DOT": variant in ("chunk", "chunk_xfirst"),
              "X_FIRST": variant == "chunk_xfirst", "JOINED": variant == "joined"}
    mix = loop_mix(compile_kernel(rg._kernels(False).rows_dot, sig, consts, warps, stages).asm["cubin"])
    return mix, block_n * lg.CHUNK // (warps * 32)


def fp8(variant, block_n, block_k, rows, warps):
    k = lg._kernels(False)
    sig = {n: t for n, t in zip(["X", "W", "S", "Y", "M", "N", "K", "stride_xm", "stride_wn"],
                                ["*bf16", "*fp8e4nv", "*fp32", "*bf16"] + ["i32"] * 5)}
    consts = {"BLOCK_N": block_n, "BLOCK_K": block_k}
    if variant != "dot":
        consts.update(ROWS_M=rows, PREFETCH=variant == "fma_prefetch")
    mix = loop_mix(compile_kernel(k.fp8_dot if variant == "dot" else k.fp8_fma, sig, consts, warps).asm["cubin"])
    return mix, block_n * block_k // (warps * 32)


def show(label, mix, per_thread):
    total = sum(mix.values())
    print(f"{label}: loop {total} instructions, {total / per_thread:.2f} per weight element; "
          + ", ".join(f"{op} {n}" for op, n in mix.most_common(10)), flush=True)


def main():
    a = sys.argv[1:]
    if a and a[0] == "int4":
        show(f"int4 {a[1:]}", *int4(*map(int, a[1:5])))
        return
    if a and a[0] in rg.VARIANTS:
        show(f"int4 GEMM {a}", *int4_gemm(a[0], *map(int, a[1:5])))
        return
    if a and a[0] in ("fma", "fma_prefetch", "dot"):
        show(f"fp8 {a}", *fp8(a[0], *map(int, a[1:5])))
        return
    for cfg in [(16, 8, 1, 4), (32, 8, 1, 4), (8, 8, 1, 2)]:
        show(f"int4 block_n={cfg[0]} chunks={cfg[1]} M={cfg[2]} warps={cfg[3]}", *int4(*cfg))
    for cfg in [("fma", 16, 512, 1, 4), ("fma_prefetch", 16, 512, 1, 4), ("dot", 64, 256, 1, 4)]:
        show(f"fp8 {cfg}", *fp8(*cfg))
    for cfg in [("planes", 128, 32, 4, 3), ("planes", 128, 16, 4, 1), ("chunk", 128, 32, 4, 3), ("chunk", 64, 32, 4, 1),
                ("chunk_xfirst", 128, 64, 4, 3), ("joined", 128, 32, 4, 1)]:
        show(f"int4 GEMM variant={cfg[0]} block_n={cfg[1]} block_m={cfg[2]} warps={cfg[3]} stages={cfg[4]}",
             *int4_gemm(*cfg))


if __name__ == "__main__":
    main()
