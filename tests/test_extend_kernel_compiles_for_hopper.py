"""The triton attention backend's extend kernel compiles for an H100/H200 (sm_90) with Triton's own compiler
and ptxas, on this machine without a GPU: the interpreter tests check the arithmetic; this checks that each
variant (plain, draft-tree masks with a window and soft-capping, an fp8 pool; the one-token requests packed
per KV-head group inside every variant) lowers to GPU code.

It runs in a child process, as tests/test_int4_kernels_compile_for_hopper.py does: a process that imported
Triton with TRITON_INTERPRET set cannot compile for a GPU."""

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
from radixserve_attention_triton import extend_kernel as ek

fn = ek._extend_kernel
out = {}
for name, group, head_dim, block_m, block_n, tree, window, cap, fp8 in json.loads(sys.argv[1]):
    kv = "*fp8e4nv" if fp8 else "*bf16"
    ptrs = {"Q": "*bf16", "Out": "*bf16", "K_new": kv, "V_new": kv, "K_buf": kv, "V_buf": kv, "ReqToToken": "*i64",
            "req_pool_idx_ptr": "*i64", "prefix_lens_ptr": "*i64", "extend_lens_ptr": "*i64", "extend_start_ptr": "*i64",
            "work_req_ptr": "*i32", "work_m_ptr": "*i32", "TreeMask": "*u8", "mask_start_ptr": "*i64", "Depth": "*i32",
            "sm_scale": "fp32", "v_scale": "fp32", "logit_cap": "fp32"}
    block_d = triton.next_power_of_2(head_dim)
    consts = dict(NUM_HEADS=8 * group, GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=block_m,
                  BLOCK_N=block_n, BLOCK_G=max(16, triton.next_power_of_2(group)), EVEN_D=block_d == head_dim,
                  HAS_TREE_MASK=tree, HAS_CAP=cap, HAS_WINDOW=window, KV_FP8=fp8)
    sig = {n: "constexpr" if n in consts else ptrs.get(n, "i32") for n in fn.arg_names}
    k = triton.compile(ASTSource(fn, sig, consts), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": 4, "num_stages": 3})
    out[name] = len(k.asm["cubin"])
print(json.dumps(out))
'''

VARIANTS = [  # name, GQA group, head_dim, BLOCK_M, BLOCK_N, tree mask, window, soft-cap, fp8 pool
    ("llama-8b", 4, 128, 64, 64, False, False, False, False),  # extend_config's tile for D=128
    ("tree+window+cap", 4, 128, 64, 64, True, True, True, False),
    ("fp8-pool", 4, 128, 64, 64, False, False, False, True),
    ("mha-d64", 1, 64, 128, 64, False, False, False, False),
    ("group8-d96", 8, 96, 64, 64, False, True, False, False),  # padded head dim
]


def test_extend_kernel_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", CHILD, json.dumps(VARIANTS)], env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert sorted(got) == sorted(v[0] for v in VARIANTS)
    assert all(size > 0 for size in got.values()), got  # ptxas turned the PTX into sm_90 machine code
