"""The batch-1 low-bit GEMVs (radixserve.layers.lowbit_gemv) under TRITON_INTERPRET=1 at small shapes,
against the dequantized reference of the same stored weights."""

import pytest
import torch
from radixserve.layers import lowbit_gemv as lg
from radixserve.layers.quant_int4 import make_int4_weight


def _int4(k, n, g_idx, seed=0, symmetric=False):
    gen = torch.Generator().manual_seed(seed)
    groups = int(g_idx.max()) + 1
    codes = torch.randint(0, 16, (k, n), generator=gen)
    scales = torch.rand(groups, n, generator=gen) * 0.1 + 0.01
    zeros = torch.full((groups, n), 8.0) if symmetric else torch.randint(0, 16, (groups, n), generator=gen).float()
    return make_int4_weight(codes, scales, zeros, g_idx, torch.float32, packed=False)


def test_row_layout_round_trip_and_plane_order():
    codes = torch.randint(0, 16, (3, 200), generator=torch.Generator().manual_seed(9))  # K padded to 256
    packed = lg.pack_rows(codes)
    assert packed.shape == (3, 32) and packed.dtype == torch.int32
    assert torch.equal(lg.unpack_rows(packed, 200), codes.int())
    # column c*128 + 16*j + w sits in int32 c*16 + w, nibble j (the kernel's static masks rely on it)
    c, j, w = 1, 4, 3  # column 195
    assert int((packed[0, c * lg.PLANE + w] >> (4 * j)) & 0xF) == int(codes[0, c * lg.CHUNK + j * lg.PLANE + w])
    assert int((packed[2, w] >> 28) & 0xF) == int(codes[2, 7 * lg.PLANE + w])


@pytest.mark.parametrize("k, n, g, m, symmetric, block_k", [
    (256, 12, 32, 1, False, 256),   # two chunks per step, two planes per group
    (192, 11, 64, 3, True, 128),    # K padded to 256 (masked activations), GPTQ-style symmetric zeros, M=3
    (256, 9, 128, 2, False, 128),   # one group per chunk, M=2
    (512, 8, 256, 4, False, 256),   # a group spans two chunks, M=4
])
def test_int4_gemv_uniform_groups_matches_dequantized(k, n, g, m, symmetric, block_k):
    w = _int4(k, n, torch.arange(k) // g, symmetric=symmetric)
    r = lg.repack_int4(w)
    assert r.group_size == g
    ref = w.dequantize(torch.float32)
    assert torch.equal(lg.dequantize_rows(r), ref)  # the repack moves codes, scales and zeros exactly
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1))
    want = x @ ref
    # fp32 accumulation that subtracts the unpacking offsets per group: ~1e-5 of the output's scale
    torch.testing.assert_close(lg.int4_gemv(x, r, lg.LowbitConfig(8, block_k, 1, 1)), want, rtol=1e-4,
                               atol=1e-4 * want.abs().max().item())
    # K cut into ranges (3 asked: as many as there are loop steps, at most), summed by each tile's last range
    for split in (2, 3):
        y = lg.int4_gemv(x, r, lg.LowbitConfig(8, block_k, 1, 1, split_k=split))
        torch.testing.assert_close(y, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
        assert not r.tile_counters.any()  # reset for the next call


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


@pytest.mark.parametrize("m, cfg", [(1, None), (3, lg.LowbitConfig(8, 32, 1, 1, "fma_prefetch")),
                                    (2, lg.LowbitConfig(16, 32, 1, 1, "dot"))])
def test_fp8_gemv_matches_dequantized_with_tails(m, cfg):
    n, k = 37, 96  # N and K not multiples of the tile
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(n, k, generator=gen).to(torch.float8_e4m3fn)
    s = torch.rand(n, generator=gen) + 0.5
    x = torch.randn(m, k, generator=gen)
    ref = x @ (w.float() * s[:, None]).t()
    tol = 1e-4 if cfg is None else 5e-3  # the dot variant rounds the activations to fp16
    torch.testing.assert_close(lg.fp8_gemv(x, w, s, cfg), ref, rtol=tol, atol=tol * ref.abs().max().item())


def test_bad_shapes_are_refused_with_the_values():
    w = lg.repack_int4(_int4(64, 8, torch.arange(64) // 32))
    with pytest.raises(ValueError, match=r"\[M<=4, 64\], got \(5, 64\)"):
        lg.int4_gemv(torch.zeros(5, 64), w)
    with pytest.raises(ValueError, match="scales"):
        lg.fp8_gemv(torch.zeros(1, 32), torch.zeros(8, 32).to(torch.float8_e4m3fn), torch.ones(7))
    with pytest.raises(ValueError, match="unknown variant 'mma'"):
        lg.fp8_gemv(torch.zeros(1, 32), torch.zeros(8, 32).to(torch.float8_e4m3fn), torch.ones(8),
                    lg.LowbitConfig(8, 32, 1, 1, "mma"))
    with pytest.raises(ValueError, match="multiple of 128, got 96"):
        lg.int4_gemv(torch.zeros(1, 64), w, lg.LowbitConfig(8, 96, 1, 1))


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
    w.rows = lg.repack_int4(w)  # what add_row_layout does to a CUDA weight (runtime.lowbit_gemv on)
    calls = []
    real = lg.int4_gemv
    monkeypatch.setattr(lg, "int4_gemv", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    y = int4_linear(x, w, bias)
    assert calls == [1]
    torch.testing.assert_close(y, x @ ref + bias, rtol=1e-4, atol=1e-4)


def test_runtime_key_resolves_per_device_and_bad_values_are_named():
    from radixserve.config import Config, ConfigError

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert Config.build({}).runtime.lowbit_gemv == "auto"
    assert lg.resolve("auto", cuda) and not lg.resolve("auto", cpu)  # the default: on for CUDA models only
    assert lg.resolve("on", cuda) and not lg.resolve("off", cuda)
    with pytest.raises(ValueError, match="lowbit_gemv=on: .* on 'cpu'"):
        lg.resolve("on", cpu)
    with pytest.raises(ConfigError, match="lowbit_gemv"):
        Config.build({"runtime": {"lowbit_gemv": "fast"}})
    with pytest.raises(ValueError, match="lowbit_gemv='fast'"):
        lg.resolve("fast", cuda)


def test_fp8_linear_routes_at_most_two_rows_to_the_row_gemv(monkeypatch):
    from radixserve_quant_fp8 import kernels as fk

    gen = torch.Generator().manual_seed(8)
    w = torch.randn(16, 64, generator=gen).to(torch.float8_e4m3fn)
    s = torch.rand(16, generator=gen) + 0.5
    calls = []
    real = lg.fp8_gemv
    monkeypatch.setattr(lg, "fp8_gemv", lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw))
    for m in (1, 2, 3):  # 3 rows: the tiled kernel (the row GEMV measured slower there)
        x = torch.randn(m, 64, generator=gen)
        torch.testing.assert_close(fk.rowwise_fp8_linear(x, w, s, row_gemv=True), x @ (w.float() * s[:, None]).t(),
                                   rtol=1e-4, atol=1e-4)
    assert calls == [1, 2]
    fk.rowwise_fp8_linear(torch.randn(1, 64, generator=gen), w, s)  # a layer without the flag: the tiled kernel
    assert calls == [1, 2]
