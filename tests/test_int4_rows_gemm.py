"""The small-batch int4 tensor-core GEMM over the row layout (radixserve.layers.int4_rows_gemm) under
TRITON_INTERPRET=1 at small shapes, against the dequantized reference of the same stored weights, and
how `int4_linear` routes batches between it, the batch-1 GEMV and the split-K kernel."""

import pytest
import torch
from radixserve.layers import int4_rows_gemm as rg
from radixserve.layers import int4_triton
from radixserve.layers import lowbit_gemv as lg
from radixserve.layers.quant_int4 import int4_linear, make_int4_weight
from radixserve.layers.split_k import plan_split_k


def _int4(k, n, g_idx, seed=0, symmetric=False, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    groups = int(g_idx.max()) + 1
    codes = torch.randint(0, 16, (k, n), generator=gen)
    scales = torch.rand(groups, n, generator=gen) * 0.1 + 0.01
    zeros = torch.full((groups, n), 8.0) if symmetric else torch.randint(0, 16, (groups, n), generator=gen).float()
    return make_int4_weight(codes, scales, zeros, g_idx, dtype, packed=False)


@pytest.mark.parametrize("k, n, g, m, cfg", [
    (256, 20, 32, 5, None),                                      # 4 planes-groups a chunk, N tail, planned split
    (192, 33, 64, 17, rg.RowsGemmConfig(16, 1, 1, False)),       # K padded to 256, 32-row activation tile, no prefetch
    (512, 16, 256, 3, rg.RowsGemmConfig(16, 1, 1, True, 3)),     # a group spans two chunks; 3 asked, 2 splits of 2
    (384, 40, 128, 40, rg.RowsGemmConfig(32, 1, 1, True, 2)),    # 64-row activation tile, uneven split (2 + 1 chunks)
    (128, 16, 128, 64, rg.RowsGemmConfig(16, 1, 1, True, 1)),    # the largest batch, one split stores x's dtype
    (256, 20, 32, 5, rg.RowsGemmConfig(16, 1, 1, True, None, variant="chunk")),  # one dot per chunk, 4 groups in it
    (192, 33, 64, 17, rg.RowsGemmConfig(16, 1, 1, False, 2, variant="chunk")),   # padded K, split, no prefetch
    (512, 16, 256, 40, rg.RowsGemmConfig(16, 1, 1, True, None, variant="chunk_xfirst")),  # activations first
    (384, 40, 128, 3, rg.RowsGemmConfig(32, 1, 1, True, 2, variant="chunk_xfirst")),      # 3 rows padded to 64
    (256, 20, 32, 5, rg.RowsGemmConfig(16, 1, 1, True, 2, reduce="kernel")),  # the splits added by the last one
    (256, 20, 32, 5, rg.RowsGemmConfig(16, 1, 1, True, None, variant="joined")),  # planes joined: 4 groups a chunk
    (512, 16, 256, 17, rg.RowsGemmConfig(16, 1, 1, False, 2, variant="joined")),  # a group over 2 chunks, split
    (384, 40, 128, 40, rg.RowsGemmConfig(32, 1, 1, True, 2, variant="chunk", reduce="kernel")),
])
def test_rows_gemm_matches_dequantized(k, n, g, m, cfg):
    w = _int4(k, n, torch.arange(k) // g, symmetric=m % 2 == 1)
    r = lg.repack_int4(w)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1))
    want = x @ w.dequantize(torch.float32)
    # fp32: the only difference is the fp32 rounding of the folded bias -(128 + zero) * scale
    y = rg.int4_rows_gemm(x, r, cfg)
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    # the split counters are back at zero, so the next call (a CUDA-graph replay) sums its own partials again
    assert not r.tile_counters.any()
    assert torch.equal(rg.int4_rows_gemm(x, r, cfg), y)


@pytest.mark.parametrize("variant", rg.VARIANTS)
def test_rows_gemm_rounds_weights_to_the_activation_dtype_like_the_reference(variant):
    k, n, m = 256, 32, 8
    w = _int4(k, n, torch.arange(k) // 64, dtype=torch.float16)
    r = lg.repack_int4(w)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(2)).half()
    y = rg.int4_rows_gemm(x, r, rg.RowsGemmConfig(16, 1, variant=variant))
    assert y.dtype == torch.float16 and y.shape == (m, n)
    # the reference: weights dequantized and stored in fp16, an fp32-accumulated product
    want = x.float() @ w.dequantize(torch.float32).half().float()
    torch.testing.assert_close(y.float(), want, rtol=2e-3, atol=2e-3 * want.abs().max().item())


def _gemm_split(n_tiles, n_chunks, cfg):
    """The K splits int4_rows_gemm asks the shared planner for (16 output rows a tile, 128-column chunks)."""
    return plan_split_k(1, 16 * n_tiles, 128 * n_chunks, 1, 16, 128, torch.device("cpu"), cfg.split_k, cfg.waves)[0]


def test_split_plan_fills_the_sms_and_keeps_two_chunks_per_program():
    # 4 "SMs" off CUDA
    assert _gemm_split(1, 32, rg.RowsGemmConfig(waves=4)) == 16  # 16 programs, 2 chunks each
    assert _gemm_split(64, 32, rg.RowsGemmConfig(waves=4)) == 1  # the output tiles already fill it
    assert _gemm_split(1, 3, rg.RowsGemmConfig(waves=4)) == 1
    assert _gemm_split(1, 3, rg.RowsGemmConfig(split_k=8)) == 3  # clamped to the chunks


def test_bad_inputs_are_refused_with_the_values():
    r = lg.repack_int4(_int4(128, 16, torch.arange(128) // 32))
    with pytest.raises(ValueError, match=r"\[M<=64, 128\], got \(65, 128\)"):
        rg.int4_rows_gemm(torch.zeros(65, 128), r)
    with pytest.raises(ValueError, match=r"got \(2, 64\)"):
        rg.int4_rows_gemm(torch.zeros(2, 64), r)
    g_idx = torch.cat([torch.full((s,), i) for i, s in enumerate((40, 88))])  # uneven groups: g_idx path only
    uneven = lg.repack_int4(_int4(128, 16, g_idx))
    assert not rg.supports(uneven)
    with pytest.raises(ValueError, match="not uniform"):
        rg.int4_rows_gemm(torch.zeros(8, 128), uneven)
    with pytest.raises(ValueError, match="variant='mma'"):
        rg.RowsGemmConfig(variant="mma")
    with pytest.raises(ValueError, match="reduce='atomic'"):
        rg.RowsGemmConfig(reduce="atomic")


@pytest.mark.parametrize("m, uneven, expected", [(2, False, "gemv"), (3, False, "rows_gemm"), (64, False, "rows_gemm"),
                                                 (3, True, "gemv"), (8, True, "fused_gemm"),
                                                 (65, False, "dequantize")])
def test_int4_linear_routes_each_batch_size_to_its_kernel(monkeypatch, m, uneven, expected):
    k, n = 256, 16
    sizes = (40, 88, 64, 64) if uneven else (64,) * 4
    g_idx = torch.cat([torch.full((s,), i) for i, s in enumerate(sizes)])
    g_idx = g_idx[torch.randperm(k, generator=torch.Generator().manual_seed(5))]  # act-order in both cases
    w = _int4(k, n, g_idx)
    assert w.perm is not None
    ref = torch.empty(k, n)
    ref[w.perm] = w.dequantize(torch.float32)
    monkeypatch.setattr(int4_triton, "available", lambda t: True)  # the CUDA branch, run by the interpreter
    w.rows = lg.repack_int4(w)  # what add_row_layout does to a CUDA weight (runtime.lowbit_gemv on)
    calls = []
    for mod, name in ((lg, "int4_gemv"), (rg, "int4_rows_gemm"), (int4_triton, "fused_gemm"),
                      (int4_triton, "dequantize")):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _real=real, _name=name, **kw: calls.append(_name) or _real(*a, **kw))
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(6))
    y = int4_linear(x, w, None)
    assert calls[0] == {"gemv": "int4_gemv", "rows_gemm": "int4_rows_gemm"}.get(expected, expected)
    torch.testing.assert_close(y, x @ ref, rtol=1e-4, atol=1e-4 * (x @ ref).abs().max().item())
