"""benchmarks/h200/profile_prefill.py splits an offline prefill chunk's kernel time by kind for issue 18's
next device call; here its kernel kinds, its FLOP count and one run of the whole script on a tiny CPU
checkpoint (the script's own check, as its docstring says)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "h200" / "profile_prefill.py"


def _module():
    spec = importlib.util.spec_from_file_location("profile_prefill", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("name,kind", [
    ("nvjet_tst_256x128_64x4_2x1_v_bz_coopA_TNT", "gemm"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64", "gemm"),
    ("aten::addmm", "gemm"),
    ("_fwd_kernel_extend", "attention"),
    ("BatchPrefillWithRaggedKVCacheKernel", "attention"),
    ("_rmsnorm_kernel", "norm"),
    ("_rotary_store_kernel", "rotary_kv_store"),
    ("silu_and_mul_kernel", "activation"),
    ("void at::native::vectorized_elementwise_kernel<4, ...>", "elementwise_copy"),
    ("some_unknown_kernel", "other"),
])
def test_kernel_kinds(name, kind):
    assert _module().kernel_kind(name) == kind


def test_the_chunk_flops_are_the_floors_per_token_flops():
    cfg = {"hidden_size": 64, "intermediate_size": 160, "num_attention_heads": 4, "num_key_value_heads": 2,
           "num_hidden_layers": 2, "vocab_size": 512}
    mod = _module()
    per_layer = 2 * (64 * 128 + 64 * 64 + 64 * 320 + 160 * 64)  # qkv (4+2*2 heads x 16), o, gate_up, down
    assert mod.chunk_gemm_flops(cfg, 3, 10) == per_layer * 2 * 30 + 2 * 64 * 512 * 3


def test_the_script_runs_on_a_tiny_cpu_checkpoint(tiny_llama_dir, tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--model", tiny_llama_dir("llama"), "--device", "cpu",
                           "--prompts", "2", "--input-len", "16", "--attention", "torch_native,no_such_backend",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads((tmp_path / "profile_prefill.json").read_text())
    row = rows["torch_native"]
    assert row["chunk_tokens"] == 32 and row["prefill_ms"] > 0 and row["kernel_ms_total"] > 0
    kinds = {k for k, _ in _module().KINDS} | {"other"}
    assert row["kernel_ms_by_kind"] and set(row["kernel_ms_by_kind"]) <= kinds  # (CPU GEMMs are native: no ops)
    assert "error" in rows["no_such_backend"]  # one backend's failure is recorded, the others still run
