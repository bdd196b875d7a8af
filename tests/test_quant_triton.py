"""The Triton kernels of the int4 (AWQ/GPTQ) and fp8 block-scaled linears against their
dequantized references, at small shapes. Without a GPU they run in Triton's CPU interpreter
(TRITON_INTERPRET=1) on CPU tensors; with one, on CUDA. The interpreter runs fp32 activations:
Triton 3.6's interpreter gets `tl.dot` wrong when an operand is converted to bf16 inside the
kernel (seen here for any source dtype), so bf16 is covered on the GPU (and benchmarks/h200_quant.py)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
if not ON_GPU:
    # set at import: triton.language decorates its helpers for the interpreter when first imported
    os.environ["TRITON_INTERPRET"] = "1"
    _lang = sys.modules.get("triton.language")
    if _lang is not None and type(_lang.standard.sum).__name__ != "InterpretedFunction":
        pytest.skip("triton.language was imported before TRITON_INTERPRET=1 was set; run this file alone",
                    allow_module_level=True)
pytest.importorskip("triton")

from radixserve.layers import int4_triton  # noqa: E402
from radixserve.layers.quant_int4 import make_int4_weight  # noqa: E402
from radixserve_quant_fp8 import kernels as fp8_kernels  # noqa: E402


def _int4_weight(k: int, n: int, group: int, act_order: bool, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (k, n), generator=gen)
    groups = k // group
    scales = torch.rand(groups, n, generator=gen) * 0.05 + 0.01
    zeros = torch.randint(0, 16, (groups, n), generator=gen).float()
    g_idx = torch.arange(k) // group
    if act_order == "uneven":  # groups of different sizes: the kernel must read scales through g_idx
        g_idx = torch.sort(torch.randint(0, groups, (k,), generator=gen)).values
    elif act_order:
        g_idx = g_idx[torch.randperm(k, generator=gen)]
    w = make_int4_weight(codes, scales, zeros, g_idx, dtype, packed=False)
    for name in ("qweight", "scales", "zeros", "g_idx", "perm"):
        t = getattr(w, name)
        if t is not None:
            setattr(w, name, t.to(DEVICE))
    return w


@pytest.fixture(params=["repeat", "reshape"])
def unpack(request, monkeypatch):
    """Both ways the int4 kernels bring codes into registers (int4_triton.UNPACK)."""
    monkeypatch.setattr(int4_triton, "UNPACK", request.param)
    return request.param


@pytest.mark.parametrize("m", [1, 7, 16, 33])
@pytest.mark.parametrize("group,act_order", [(32, False), (64, True), (128, False), (32, "uneven")])
def test_int4_fused_gemm_matches_dequantized_reference(m, group, act_order, unpack):
    dtype = torch.float16 if ON_GPU else torch.float32
    w = _int4_weight(256, 96, group, act_order, dtype)
    # sorted act-order groups are whole groups again: both take the per-group scale path
    assert (int4_triton._group_size(w, 128) == 0) == (act_order == "uneven")
    ref_w = w.dequantize(torch.float32)
    x = torch.randn(m, 256, generator=torch.Generator().manual_seed(m)).to(DEVICE, dtype)
    xp = x[:, w.perm] if w.perm is not None else x
    for split_k in (1, 2):
        y = int4_triton.fused_gemm(xp, w, split_k=split_k)
        assert y.dtype == dtype and y.shape == (m, 96)
        want = xp.float() @ ref_w.float()
        torch.testing.assert_close(y.float(), want, rtol=2e-3, atol=2e-3 * float(want.abs().max()))


def test_int4_dequantize_kernel_is_exact(unpack):
    w = _int4_weight(128, 64, 32, True, torch.float32)
    codes_ref = w.dequantize(torch.float32)  # torch path on CPU / the same kernel on GPU
    got = int4_triton.dequantize(w, torch.float32)
    if not ON_GPU:
        assert torch.equal(got, codes_ref)
    torch.testing.assert_close(got, codes_ref)


@pytest.mark.parametrize("m", [1, 5, 20])
def test_fp8_block_gemm_matches_dequantized_reference(m):
    gen = torch.Generator().manual_seed(m)
    weight = (torch.randn(256, 384, generator=gen) * 4).to(torch.float8_e4m3fn)
    scale = torch.rand(2, 3, generator=gen) * 0.01 + 1e-3
    deq = weight.float() * scale.repeat_interleave(128, 0).repeat_interleave(128, 1)
    dtype = torch.bfloat16 if ON_GPU else torch.float32
    x = torch.randn(m, 384, generator=gen).to(dtype)
    want = x.float() @ deq.T
    for split_k in (1, 3):
        y = fp8_kernels.block_fp8_gemm(x.to(DEVICE), weight.to(DEVICE), scale.to(DEVICE), (128, 128), split_k=split_k)
        tol = 2e-2 if ON_GPU else 1e-4
        torch.testing.assert_close(y.float().cpu(), want, rtol=tol, atol=tol * float(want.abs().max()))


@pytest.mark.parametrize("m,rows", [(1, 16), (5, 16), (16, 16)])
def test_fp8_per_token_quantization_kernel_matches_torch(m, rows):
    x = (torch.randn(m, 300, generator=torch.Generator().manual_seed(m)) * 3).to(DEVICE)
    q, s = fp8_kernels.quantize_per_token_padded(x, rows)
    q_ref, s_ref = fp8_kernels.quantize_per_token(x)
    torch.testing.assert_close(s[:m], s_ref, rtol=1e-6, atol=0)
    if ON_GPU:
        assert torch.equal(q[:m].float(), q_ref.float())
    else:
        # Triton's interpreter drops the carry when float32 -> e4m3 rounding reaches the next power
        # of two (-124.7 becomes -64, not -128); the GPU converts in hardware. Every other element
        # must match exactly, and those few must be exactly such a case.
        diff = q[:m].float() != q_ref.float()
        assert int(diff.sum()) <= 0.05 * diff.numel()
        assert torch.equal(q[:m].float()[diff] * 2, q_ref.float()[diff])
    assert torch.equal(q[m:].float(), torch.zeros(rows - m, 300, device=DEVICE))  # padding adds nothing


def test_fp8_rowwise_triton_path_matches_dequantized_reference():
    """Decode-sized batches of per-channel fp8 weights: the block kernel with one scale per row."""
    gen = torch.Generator().manual_seed(9)
    weight = (torch.randn(96, 256, generator=gen) * 4).to(torch.float8_e4m3fn)
    rows = torch.rand(96, generator=gen) * 0.01 + 1e-3
    x = torch.randn(3, 256, generator=gen)
    want = x @ (weight.float() * rows[:, None]).T
    dtype = torch.bfloat16 if ON_GPU else torch.float32
    y = fp8_kernels.block_fp8_gemm(x.to(DEVICE, dtype), weight.to(DEVICE), rows.to(DEVICE)[:, None], (1, 256))
    tol = 2e-2 if ON_GPU else 1e-4
    torch.testing.assert_close(y.float().cpu(), want, rtol=tol, atol=tol * float(want.abs().max()))
