"""The int4 CUDA kernels (the batch-1 GEMV of `lowbit_gemv` and the tensor-core GEMM of `int4_rows_gemm`)
compile for an H100/H200 (sm_90) with Triton's own compiler and ptxas, on this machine without a GPU: the
interpreter tests check the arithmetic, this checks that every variant and split mode lowers to GPU code
(a run-time choice between pointers of two dtypes, say, runs in the interpreter and fails to compile).

It runs in a child process: Triton decorates its own library for the interpreter when TRITON_INTERPRET is
set at import (as the test session does), and such a process cannot compile for a GPU."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

CHILD = r'''
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from radixserve.layers import int4_rows_gemm as rg, lowbit_gemv as lg

PTRS = {n: "*bf16" for n in ("X", "S", "Z", "Y")} | {"C": "*i32", "GI": "*i32", "WS": "*fp32", "CNT": "*i32"}

def compile_(fn, consts, num_warps, num_stages):
    constexprs = {fn.arg_names[i] for i in fn.constexprs}
    consts = {k: v for k, v in consts.items() if k in constexprs}  # SPLITS is a run-time value in the GEMM
    sig = {n: "constexpr" if n in consts else PTRS.get(n, "i32") for n in fn.arg_names}
    k = triton.compile(ASTSource(fn, sig, consts), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": num_warps, "num_stages": num_stages})
    return {"cubin_bytes": len(k.asm["cubin"]), "atomics": "atom" in k.asm["ptx"]}

out = {}
for variant, splits, reduce_here, block_m, stages in json.loads(sys.argv[1]):
    out[f"gemm {variant} {splits} {reduce_here}"] = compile_(rg._kernels(False).rows_dot, dict(
        SPLITS=splits, REDUCE_HERE=reduce_here, BLOCK_N=128, BLOCK_M=block_m, PG=8, GS=128, PLANE_=lg.PLANE,
        CK=lg.CHUNK, PREFETCH=stages == 1, ONE_DOT=variant in ("chunk", "chunk_xfirst"),
        X_FIRST=variant == "chunk_xfirst", JOINED=variant == "joined"), 4, stages)
for splits, rows_m in json.loads(sys.argv[2]):
    out[f"gemv {splits} {rows_m}"] = compile_(lg._kernels(False).int4, dict(
        SPLITS=splits, BLOCK_N=32, CH=8, PG=8, GS=128, ROWS_M=rows_m, PLANE_=lg.PLANE), 8, 1)
print(json.dumps(out))
'''

GEMMS = [("planes", 1, False, 32, 3),     # the default (no split at large N)
         ("planes", 4, False, 16, 3),     # K split, partials added by torch (the default reduction)
         ("planes", 4, True, 32, 1),      # K split added by each tile's last split
         ("chunk", 4, True, 32, 3),
         ("chunk_xfirst", 2, False, 64, 3),
         ("joined", 4, False, 32, 1)]
GEMVS = [(1, 1), (4, 4)]


def test_int4_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", CHILD, json.dumps(GEMMS), json.dumps(GEMVS)], env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert len(got) == len(GEMMS) + len(GEMVS)
    for name, k in got.items():
        assert k["cubin_bytes"] > 0, name  # ptxas turned the PTX into sm_90 machine code
    # the split counter's atomics appear exactly where the splits are added up inside the kernel
    assert [got[f"gemm {v} {s} {r}"]["atomics"] for v, s, r, _, _ in GEMMS] == [r for _, _, r, _, _ in GEMMS]
    assert [got[f"gemv {s} {m}"]["atomics"] for s, m in GEMVS] == [s > 1 for s, _ in GEMVS]
