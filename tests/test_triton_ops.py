"""The fused Triton layer kernels (radixserve.layers.triton_ops) against the layers' torch code.

Without a GPU the kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1) on CPU tensors; with
one, the same tests run on CUDA. The references are the layers' own torch paths (`RMSNorm._norm`,
`F.silu(gate) * up`, `RotaryEmbedding._rotate`), which the CPU layers keep using.

The interpreter casts float32 -> bfloat16 by truncation, where a GPU (and torch) rounds to nearest
even; `triton_interpret.round_bf16_like_gpu` makes the interpreter round as the GPU does, so bf16 results can be
compared as strictly here as they would be on a GPU.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.nn.functional as F
from radixserve.layers import triton_ops
from radixserve.layers.activation import SiluAndMul
from radixserve.layers.norm import RMSNorm
from radixserve.layers.rotary import RotaryEmbedding
from triton_interpret import round_bf16_like_gpu

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
_PREV_INTERPRET = os.environ.get("TRITON_INTERPRET")
if not ON_GPU:
    # Set at import, not per test: triton.language's own jitted helpers (tl.sum) are decorated for
    # the interpreter only if it is on when triton.language is first imported, and collecting other
    # modules can import it (torch._dynamo does). Our kernels are built on first call, per mode.
    os.environ["TRITON_INTERPRET"] = "1"
    _lang = sys.modules.get("triton.language")
    if _lang is not None and type(_lang.standard.sum).__name__ != "InterpretedFunction":
        pytest.skip(
            "triton.language was imported before TRITON_INTERPRET=1 was set (by a module collected "
            "earlier); run this file first or alone",
            allow_module_level=True,
        )
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(autouse=True, scope="module")
def _interpreter():
    """On CPU: keep the interpreter on for this module's tests only (later tests may spawn
    processes), rounding bf16 as a GPU does."""
    if ON_GPU:
        yield
        return
    os.environ["TRITON_INTERPRET"] = "1"
    undo = round_bf16_like_gpu()
    try:
        yield
    finally:
        undo()
        if _PREV_INTERPRET is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = _PREV_INTERPRET


def assert_within_one_ulp(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal up to one unit in the last place of a bf16 result, or a few of a float32 one (the sum of
    squares is added in another order, exp is another implementation): rounding noise, not recipe."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    assert torch.equal(actual.isnan(), expected.isnan())
    a, e = actual.float(), expected.float()
    eps = torch.finfo(actual.dtype).eps * (8 if actual.dtype == torch.float32 else 1)
    bad = ((a - e).abs() > eps * e.abs() + 1e-30) & ~expected.isnan()
    assert not bad.any(), f"{int(bad.sum())} elements off by more than one ulp, max {(a - e).abs().max()}"
    if actual.dtype != torch.float32:
        # and an off-by-one is rare: a recipe that skipped one of torch's roundings to the dtype
        # would differ in about a quarter of the elements
        differ = (a != e) & ~expected.isnan()
        assert differ.float().mean() <= 0.01, f"{int(differ.sum())} of {differ.numel()} elements differ"


def ref_rmsnorm(x, weight, eps, residual=None):
    """RMSNorm.forward's torch path (the layer dispatches to the kernel for CUDA tensors)."""
    norm = RMSNorm(x.shape[-1], eps, params_dtype=weight.dtype).to(x.device)
    norm.weight.data.copy_(weight)
    if residual is None:
        return norm._norm(x)
    x = x + residual
    return norm._norm(x), x


# ---------------------------------------------------------------- RMSNorm


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden", [64, 1000, 4096])
@pytest.mark.parametrize("rows", [1, 3, 17])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rmsnorm_matches_torch(dtype, hidden, rows, with_residual):
    gen = torch.Generator().manual_seed(hidden * 100 + rows)
    x = (3 * torch.randn(rows, hidden, generator=gen)).to(DEVICE, dtype)
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(DEVICE, dtype)
    residual = torch.randn(rows, hidden, generator=gen).to(DEVICE, dtype) if with_residual else None
    got = triton_ops.rmsnorm(x, weight, 1e-6, residual)
    want = ref_rmsnorm(x, weight, 1e-6, residual)
    if with_residual:
        (got, got_sum), (want, want_sum) = got, want
        assert torch.equal(got_sum, want_sum)  # the add is one rounding in both
    assert_within_one_ulp(got, want)


def test_rmsnorm_strided_3d_input_and_weight_promotion():
    """Qwen3's per-head q/k norm passes a [n, heads, head_dim] view of the fused qkv output; a float32
    weight on bfloat16 activations gives a float32 output, as `weight * normed` does in torch."""
    gen = torch.Generator().manual_seed(1)
    qkv = torch.randn(5, 3 * 4 * 32, generator=gen).to(DEVICE, torch.bfloat16)
    q = qkv[:, : 4 * 32].reshape(5, 4, 32)
    assert not q.is_contiguous()
    weight = (1 + 0.1 * torch.randn(32, generator=gen)).to(DEVICE)
    got = triton_ops.rmsnorm(q, weight, 1e-5)
    want = ref_rmsnorm(q, weight, 1e-5)
    assert got.dtype == torch.float32 and got.shape == (5, 4, 32)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------- SiLU and mul


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d", [64, 1000, 2048])
@pytest.mark.parametrize("rows", [1, 3, 17])
def test_silu_and_mul_matches_torch(dtype, d, rows):
    gen = torch.Generator().manual_seed(d * 100 + rows)
    x = (4 * torch.randn(rows, 2 * d, generator=gen)).to(DEVICE, dtype)
    gate, up = x.chunk(2, dim=-1)
    want = F.silu(gate) * up
    got = triton_ops.silu_and_mul(x)
    assert got.shape == (rows, d)
    assert_within_one_ulp(got, want)  # exp differs from torch's in the last fp32 bits


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # numpy, in the interpreter
def test_silu_and_mul_extremes():
    """Saturated gates: exp overflows to inf for very negative gates (silu -> -0), is 0 for positive."""
    gate = torch.tensor([[-1e4, -100.0, -20.0, 0.0, 20.0, 100.0, 1e4, 3.0]])
    x = torch.cat([gate, torch.full_like(gate, 2.0)], dim=-1).to(DEVICE)
    gate, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(triton_ops.silu_and_mul(x), F.silu(gate) * up, rtol=1e-6, atol=0)


# ---------------------------------------------------------------- rotary


def _rope_case(n, hq, hkv, head_dim, rotary_dim, dtype, seed=0):
    rope = RotaryEmbedding(head_dim, rotary_dim, 4096, {"rope_theta": 500000.0, "rope_type": "default"})
    gen = torch.Generator().manual_seed(seed)
    positions = torch.randint(0, 4096, (n,), generator=gen).to(DEVICE)
    # q and k as the model has them: column slices of one fused qkv projection (strided rows)
    qkv = torch.randn(n, (hq + 2 * hkv) * head_dim, generator=gen).to(DEVICE, dtype)
    q, k, _ = qkv.split([hq * head_dim, hkv * head_dim, hkv * head_dim], dim=-1)
    cos, sin = rope.to(DEVICE)._cos_sin(positions)
    return rope, q, k, cos.to(dtype), sin.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "head_dim,rotary_dim,hq,hkv",
    [(64, 64, 8, 2), (128, 128, 32, 8), (128, 64, 6, 2), (64, 32, 3, 1), (80, 48, 5, 5)],
)
@pytest.mark.parametrize("n", [1, 17])
def test_rotary_matches_torch_bitwise(dtype, head_dim, rotary_dim, hq, hkv, n):
    rope, q, k, cos, sin = _rope_case(n, hq, hkv, head_dim, rotary_dim, dtype, seed=n)
    q_before, k_before = q.clone(), k.clone()
    q_rot, k_rot = triton_ops.rotary(q, k, cos, sin, head_dim, rotary_dim)
    # same roundings as torch (rot*cos, rotate_half*sin, their sum): bit-equal in both dtypes
    assert torch.equal(q_rot, rope._rotate(q, cos, sin))
    assert torch.equal(k_rot, rope._rotate(k, cos, sin))
    assert torch.equal(q, q_before) and torch.equal(k, k_before)  # out of place
    # the layer's path: whole fp32 caches + positions, gathered and cast to q's dtype in the kernel
    positions = torch.randint(0, 4096, (n,), generator=torch.Generator().manual_seed(n + 1)).to(DEVICE)
    tables = rope.to(DEVICE)._tables(positions)
    cos_p, sin_p = (t[positions].to(dtype) for t in tables)
    q_rot, k_rot = triton_ops.rotary(q, k, *tables, head_dim, rotary_dim, positions=positions)
    assert torch.equal(q_rot, rope._rotate(q, cos_p, sin_p)) and torch.equal(k_rot, rope._rotate(k, cos_p, sin_p))


# ---------------------------------------------------------------- NaN, empty, dispatch


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_nan_propagates(dtype):
    x = torch.randn(3, 64).to(DEVICE, dtype)
    x[1, 5] = float("nan")
    out, summed = triton_ops.rmsnorm(x, torch.ones(64, device=DEVICE, dtype=dtype), 1e-6, torch.zeros_like(x))
    assert out[1].isnan().all() and not out[[0, 2]].isnan().any()  # the row's statistics are NaN
    assert summed[1, 5].isnan()

    g = torch.randn(3, 128).to(DEVICE, dtype)
    g[0, 3] = float("nan")  # a gate
    g[2, 64 + 7] = float("nan")  # an up
    act = triton_ops.silu_and_mul(g)
    assert torch.equal(act.isnan(), (F.silu(g[:, :64]) * g[:, 64:]).isnan())
    assert act.isnan().sum() == 2

    rope, q, k, cos, sin = _rope_case(2, 2, 1, 64, 64, dtype)
    q[0, 10] = float("nan")  # first half of head 0: feeds dims 10 and 42 of that head
    q_rot, k_rot = triton_ops.rotary(q, k, cos, sin, 64, 64)
    assert torch.equal(q_rot.isnan(), rope._rotate(q, cos, sin).isnan())
    assert q_rot.isnan().sum() == 2 and not k_rot.isnan().any()


def test_empty_batch():
    x = torch.empty(0, 64, device=DEVICE)
    assert triton_ops.rmsnorm(x, torch.ones(64, device=DEVICE), 1e-6).shape == (0, 64)
    assert triton_ops.silu_and_mul(torch.empty(0, 128, device=DEVICE)).shape == (0, 64)
    q_rot, k_rot = triton_ops.rotary(x, x, torch.empty(0, 64, device=DEVICE), torch.empty(0, 64, device=DEVICE), 64, 64)
    assert q_rot.shape == k_rot.shape == (0, 64)


def test_cpu_layers_keep_the_torch_path(monkeypatch):
    """`available` is CUDA-only, so CPU layers never reach the kernels (even when interpreting)."""
    assert not triton_ops.available(torch.zeros(1))

    def refuse(*args, **kwargs):
        raise AssertionError("a CPU layer called a Triton kernel")

    for name in ("rmsnorm", "silu_and_mul", "rotary"):
        monkeypatch.setattr(triton_ops, name, refuse)
    x = torch.randn(2, 64)
    RMSNorm(64)(x, x)
    SiluAndMul()(x)
    RotaryEmbedding(16, 16, 64, {"rope_theta": 10000.0, "rope_type": "default"})(torch.arange(2), x, x)


@pytest.mark.skipif(not ON_GPU, reason="the layers dispatch to the kernels only for CUDA tensors")
def test_cuda_layers_use_the_kernels_and_match():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(9, 512, generator=gen).to(DEVICE, torch.bfloat16)
    r = torch.randn(9, 512, generator=gen).to(DEVICE, torch.bfloat16)
    norm = RMSNorm(512, 1e-6, params_dtype=torch.bfloat16).to(DEVICE)
    out, summed = norm(x, r)
    want, want_sum = ref_rmsnorm(x, norm.weight, 1e-6, r)
    assert torch.equal(summed, want_sum)
    assert_within_one_ulp(out, want)
    gate, up = x.chunk(2, dim=-1)
    assert_within_one_ulp(SiluAndMul()(x), F.silu(gate) * up)
    rope, q, k, cos, sin = _rope_case(9, 4, 2, 128, 128, torch.bfloat16)
    q_rot, k_rot = rope(torch.arange(9, device=DEVICE), q, k)
    c, s = rope._cos_sin(torch.arange(9, device=DEVICE))
    assert torch.equal(q_rot, rope._rotate(q, c.to(q.dtype), s.to(q.dtype)))


@pytest.mark.parametrize("partial_rotary", [1.0, 0.5])
def test_model_forward_through_the_kernels_matches_torch(monkeypatch, partial_rotary):
    """A tiny Qwen3 (per-head q/k norm on strided 3D views, q/k sliced from the fused qkv) run with the
    layers forced onto the kernels gives the torch path's hidden states (the attention backend is a
    stand-in that returns q: this checks the layers, not attention)."""
    transformers = pytest.importorskip("transformers")
    models = pytest.importorskip("radixserve_models_llama.model")
    config = transformers.Qwen3Config(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        vocab_size=100,
        max_position_embeddings=256,
        partial_rotary_factor=partial_rotary,
    )
    torch.manual_seed(0)
    model = models.Qwen3ForCausalLM(config).to(DEVICE)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(0.2 * torch.randn_like(p) + (1.0 if p.dim() == 1 else 0.0))
    batch = type("Batch", (), {"attn_backend": type("Stub", (), {"forward": staticmethod(lambda q, *a: q)})})()
    ids, positions = torch.randint(0, 100, (7,), device=DEVICE), torch.arange(3, 10, device=DEVICE)
    with torch.no_grad():
        monkeypatch.setattr(triton_ops, "available", lambda t: False)
        want = model(ids, positions, batch)
        monkeypatch.setattr(triton_ops, "available", lambda t: True)
        got = model(ids, positions, batch)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
