"""The batch-1 low-bit GEMVs (radixserve.layers.lowbit_gemv) under TRITON_INTERPRET=1 at small shapes,
against the dequantized reference of the same stored weights."""

import pytest
import torch
from radixserve.layers import lowbit_gemv as lg
from radixserve.layers.quant_int4 import make_int4_weight


def _int4(k, n, g_idx, seed=0):
    gen = torch.Generator().manual_seed(seed)
    groups = int(g_idx.max()) + 1
    codes = torch.randint(0, 16, (k, n), generator=gen)
    scales = torch.rand(groups, n, generator=gen) * 0.1 + 0.01
    zeros = torch.randint(0, 16, (groups, n), generator=gen).float()
    return make_int4_weight(codes, scales, zeros, g_idx, torch.float32, packed=False)


@pytest.mark.parametrize("k, n, g, m", [(256, 40, 32, 1), (256, 37, 128, 3)])
def test_int4_gemv_uniform_groups_matches_dequantized(k, n, g, m):
    w = _int4(k, n, torch.arange(k) // g)
    r = lg.repack_int4(w)
    assert r.group_size == g
    ref = w.dequantize(torch.float32)
    assert torch.equal(lg.dequantize_rows(r), ref)  # the repack moves codes, scales and zeros exactly
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(lg.int4_gemv(x, r), x @ ref, rtol=1e-4, atol=1e-4)


def test_int4_gemv_act_order_and_uneven_groups():
    k, n = 256, 24
    # act-order: groups shuffled across rows; uneven sizes so the sorted rows are not k // g either
    g_idx = torch.cat([torch.full((s,), i) for i, s in enumerate((40, 88, 64, 64))])
    g_idx = g_idx[torch.randperm(k, generator=torch.Generator().manual_seed(2))]
    w = _int4(k, n, g_idx)
    assert w.perm is not None and w.uniform_group_size is None
    r = lg.repack_int4(w)
    x = torch.randn(2, k, generator=torch.Generator().manual_seed(3))
    # the caller permutes x as int4_linear does; the result equals the unpermuted reference
    codes = torch.empty(k, n)
    codes[w.perm] = w.dequantize(torch.float32)
    torch.testing.assert_close(lg.int4_gemv(x[:, w.perm], r), x @ codes, rtol=1e-4, atol=1e-4)


def test_fp8_gemv_matches_dequantized_with_tails():
    n, k = 37, 96  # N and K not multiples of the tile
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(n, k, generator=gen).to(torch.float8_e4m3fn)
    s = torch.rand(n, generator=gen) + 0.5
    x = torch.randn(2, k, generator=gen)
    torch.testing.assert_close(lg.fp8_gemv(x, w, s), x @ (w.float() * s[:, None]).t(), rtol=1e-4, atol=1e-4)


def test_bad_shapes_are_refused_with_the_values():
    w = lg.repack_int4(_int4(64, 8, torch.arange(64) // 32))
    with pytest.raises(ValueError, match=r"\[M<=4, 64\], got \(5, 64\)"):
        lg.int4_gemv(torch.zeros(5, 64), w)
    with pytest.raises(ValueError, match="scales"):
        lg.fp8_gemv(torch.zeros(1, 32), torch.zeros(8, 32).to(torch.float8_e4m3fn), torch.ones(7))


def test_int4_linear_routes_small_batches_to_the_row_gemv_with_act_order(monkeypatch):
    from radixserve.layers import int4_triton
    from radixserve.layers.quant_int4 import int4_linear

    k, n = 128, 16
    g_idx = (torch.arange(k) // 32)[torch.randperm(k, generator=torch.Generator().manual_seed(5))]
    w = _int4(k, n, g_idx)
    ref = torch.empty(k, n)
    ref[w.perm] = w.dequantize(torch.float32)
    x = torch.randn(1, 1, k, generator=torch.Generator().manual_seed(6))
    bias = torch.randn(n, generator=torch.Generator().manual_seed(7))
    monkeypatch.setattr(int4_triton, "available", lambda t: True)  # the CUDA branch, run by the interpreter
    w.rows = lg.repack_int4(w)  # what make_int4_weight does on CUDA with RADIXSERVE_LOWBIT_GEMV=1
    calls = []
    real = lg.int4_gemv
    monkeypatch.setattr(lg, "int4_gemv", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    y = int4_linear(x, w, bias)
    assert calls == [1]
    torch.testing.assert_close(y, x @ ref + bias, rtol=1e-4, atol=1e-4)
