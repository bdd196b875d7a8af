"""The C++ CPU kernels (radixserve.native): fused RMSNorm / SiLU-and-mul / rotary (cpu_ops) and the
cpu_batched backend's decode attention, each against the torch code it replaces.

CI has a compiler, so these tests require the kernels to build: a broken build fails here instead
of silently falling back to the (slower) torch paths."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from radixserve import native
from radixserve.layers import cpu_gemm, cpu_ops
from radixserve.layers.activation import SiluAndMul
from radixserve.layers.norm import RMSNorm
from radixserve.layers.rotary import RotaryEmbedding
from radixserve.memory import KVPool, ReqToTokenPool
from radixserve.model_runner import AttentionRunnerInfo
from radixserve.state import ForwardBatch, ForwardMode
from radixserve_attention_cpu_batched.backend import CPUBatchedBackend


def test_kernels_build_here():
    assert cpu_ops.available(torch.zeros(1, 4)), "the fused CPU kernels did not build (see the log)"
    assert not cpu_ops.available(torch.zeros(1, 4, dtype=torch.bfloat16))  # fp32 only
    assert not cpu_ops.available(torch.zeros(4, 2).t())  # rows must be contiguous
    # conftest's up-front parallel build asks native.is_cached with these (source, defines): they
    # must be what the loaders use, or every CI run compiles the kernels one by one in-process
    from native_builds import KERNELS, sources

    for name, (source, defines) in sources().items():
        KERNELS[name]()  # a cache hit after the session start
        assert native.is_cached(name, source, defines), name


def _cpu_has_avx512() -> bool:
    with open("/proc/cpuinfo") as f:
        return any(line.startswith("flags") and " avx512f" in line for line in f)


# The GEMM builds this machine runs: the default one (AVX-512 where the CPU has it) and, on such a
# CPU, the AVX2 kernel forced by RS_NO_AVX512, which AVX2-only machines use; CI may be either.
GEMM_BUILDS = ["default"] + (["avx2"] if _cpu_has_avx512() else [])


def _gemm_module(build: str):
    if build == "default":
        module = cpu_gemm._native_gemm()
    else:
        module = native.load_extension("radixserve_cpu_gemm_avx2", cpu_gemm._SOURCE, defines=("RS_NO_AVX512",))
    assert module is not None and module.available(), f"the native GEMM ({build}) did not build"
    return module


def test_gemm_builds_have_their_panel_widths():
    widths = {build: _gemm_module(build).panel_width() for build in GEMM_BUILDS}
    assert widths == {"default": 48 if _cpu_has_avx512() else 24, **({"avx2": 24} if "avx2" in widths else {})}


@pytest.mark.parametrize("build", GEMM_BUILDS)
@pytest.mark.parametrize(
    ("rows", "out_features", "in_features"),
    [(r, n, k) for r in (1, 3, 4, 5, 7, 8, 9, 13, 64, 300) for n, k in ((960, 576), (50, 1536), (24, 7))]
    + [(9, 3000, 2500), (64, 3000, 2500)],
)
def test_packed_gemm_matches_f_linear(build, rows, out_features, in_features):
    """Full and partial panels (24 and 48 columns), every row remainder of the 4- and 8-row
    microkernels, row chunks (300 rows of 1536 features do not fit one L2 chunk) and K blocks
    (2500 > both kernels' K block), with and without bias."""
    gemm = _gemm_module(build)
    gen = torch.Generator().manual_seed(rows * out_features)
    weight, bias = torch.randn(out_features, in_features, generator=gen), torch.randn(out_features, generator=gen)
    x = torch.randn(rows, in_features, generator=gen)
    panels = gemm.pack(weight)
    assert panels.shape == (-(-out_features // gemm.panel_width()), in_features, gemm.panel_width())
    tol = {"rtol": 1e-5, "atol": 1e-4 * max(1.0, in_features / 1000)}
    torch.testing.assert_close(gemm.linear(x, panels, out_features), F.linear(x, weight), **tol)
    strided = torch.randn(rows, 2 * in_features, generator=gen)[:, ::2]
    torch.testing.assert_close(gemm.linear(strided.contiguous(), panels, out_features), F.linear(strided, weight), **tol)
    if build == "default":  # the layer-facing wrapper: bias, strided rows
        packed = cpu_gemm.pack(weight)
        assert packed is not None and packed.panels is not None
        for b in (None, bias):
            torch.testing.assert_close(cpu_gemm.linear(x, weight, packed, b), F.linear(x, weight, b), **tol)
        torch.testing.assert_close(cpu_gemm.linear(strided, weight, packed), F.linear(strided, weight), **tol)


@pytest.mark.parametrize("build", GEMM_BUILDS)
@pytest.mark.parametrize(("rows", "inter", "in_features"), [(1, 50, 40), (9, 100, 40), (64, 1536, 40), (300, 100, 1536)])
def test_silu_gated_gemm_matches_torch(build, rows, inter, in_features):
    """The last case spans several row chunks (300 rows of 1536 features), taken as tasks of one region."""
    gemm = _gemm_module(build)
    gen = torch.Generator().manual_seed(rows + inter)
    # pre-activations of unit scale: silu(gate) * up of two fp32 sums of 1536 terms each keeps ~1e-6 relative error
    weight = torch.randn(2 * inter, in_features, generator=gen) / in_features**0.5
    x = torch.randn(rows, in_features, generator=gen)
    want = SiluAndMul()(F.linear(x, weight))
    torch.testing.assert_close(gemm.linear_silu_mul(x, gemm.pack_gated(weight), inter), want, rtol=1e-5, atol=1e-5)


def _bf16(t: torch.Tensor) -> torch.Tensor:
    return t.bfloat16().float()


@pytest.mark.parametrize("build", GEMM_BUILDS)
@pytest.mark.parametrize(("rows", "out_features", "in_features"),
                         [(1, 50, 7), (3, 960, 576), (5, 100, 385), (13, 24, 1536), (64, 50, 400)])
def test_widened_bf16_panels_give_the_bf16_weights_product(build, rows, out_features, in_features):
    """runtime.cpu_matmul_precision=medium on every build, AVX2-only machines included: bf16 panels
    multiplied with widened weights give x @ bf16(w)^T in fp32 (the AVX2 kernel widens a K block at
    a time: 1536 features span eight 192-value blocks; odd K, partial panels, row remainders)."""
    gemm = _gemm_module(build)
    assert gemm.bf16_available()
    gen = torch.Generator().manual_seed(rows * out_features + in_features)
    weight, x = torch.randn(out_features, in_features, generator=gen), torch.randn(rows, in_features, generator=gen)
    width = gemm.panel_width()
    panels = gemm.to_bf16_panels(gemm.pack(weight))
    assert panels.dtype == torch.int16 and panels.shape == (-(-out_features // width), (in_features + 1) // 2, width, 2)
    tol = {"rtol": 1e-5, "atol": 1e-4 * max(1.0, in_features / 1000)}
    got = gemm.linear(x, panels, out_features, True)
    torch.testing.assert_close(got, F.linear(x, _bf16(weight)), **tol)
    if in_features > 16:  # really the bf16 weights: the fp32 product is measurably elsewhere
        assert (got - F.linear(x, weight)).abs().max() > 1e-3
    gated = (torch.randn(2 * out_features, in_features, generator=gen) / in_features**0.5)
    want = SiluAndMul()(F.linear(x, _bf16(gated)))
    torch.testing.assert_close(gemm.linear_silu_mul(x, gemm.to_bf16_panels(gemm.pack_gated(gated)), out_features, True),
                               want, rtol=1e-5, atol=1e-5)
    if not gemm.bf16_dot_available():  # no vdpbf16ps in this build: asking for it is an error, not the other product
        with pytest.raises(RuntimeError, match="vdpbf16ps products need a build with AVX-512 BF16"):
            gemm.linear(x, panels, out_features, False)


@pytest.mark.parametrize("rows", [1, 7, 64])
def test_rmsnorm_matches_torch(rows):
    gen = torch.Generator().manual_seed(rows)
    norm = RMSNorm(96, eps=1e-5)
    norm.weight.data = torch.randn(96, generator=gen)
    x, res = torch.randn(rows, 96, generator=gen), torch.randn(rows, 96, generator=gen)
    torch.testing.assert_close(norm(x), norm._norm(x), rtol=1e-5, atol=1e-5)
    out, new_res = norm(x, res)
    torch.testing.assert_close(new_res, x + res, rtol=0, atol=0)
    torch.testing.assert_close(out, norm._norm(x + res), rtol=1e-5, atol=1e-5)
    wide = torch.randn(rows, 2 * 96, generator=gen)[:, :96]  # strided rows, as slices of a wider output
    torch.testing.assert_close(norm(wide), norm._norm(wide), rtol=1e-5, atol=1e-5)


def test_argmax_rows_matches_torch_argmax():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(9, 5000, generator=gen)
    x[2, 10], x[2, 4000] = float("nan"), float("nan")  # the first NaN wins
    x[3, 7] = float("inf")
    x[4] = 1.0  # ties: the first index
    x[5, 4999] = 50.0  # the last column
    x[6] = float("-inf")  # a row of -inf: index 0 (the scan is bounded under -ffast-math)
    x[7] = -1.0
    x[7, 30], x[7, 600] = -0.0, 0.0  # -0 ties with +0: the first of them
    for m in (x, x[:, :777]):  # and strided rows
        assert torch.equal(cpu_ops.argmax_rows(m), torch.argmax(m, dim=-1))


def test_silu_and_mul_matches_torch():
    x = 4 * torch.randn(33, 2 * 80, generator=torch.Generator().manual_seed(0))
    gate, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(SiluAndMul()(x), F.silu(gate) * up, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("rotary_dim", [64, 32])  # full and partial rotary
def test_rotary_matches_torch_on_fused_qkv_slices(rotary_dim):
    rope = RotaryEmbedding(64, rotary_dim, 1024, {"rope_theta": 10000.0, "rope_type": "default"})
    gen = torch.Generator().manual_seed(rotary_dim)
    qkv = torch.randn(20, 9 * 64 + 2 * 3 * 64, generator=gen)
    q, k, _ = qkv.split([9 * 64, 3 * 64, 3 * 64], dim=-1)  # strided rows
    before = qkv.clone()
    positions = torch.randint(0, 1024, (20,), generator=gen)
    q_rot, k_rot = rope(positions, q, k)
    cos, sin = rope._cos_sin(positions)
    torch.testing.assert_close(q_rot, rope._rotate(q, cos, sin), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(k_rot, rope._rotate(k, cos, sin), rtol=1e-6, atol=1e-6)
    assert torch.equal(qkv, before), "the inputs must not be modified"
    with pytest.raises(RuntimeError, match="outside the table"):
        cpu_ops.rotary(q, k, torch.full((20,), 10**6), *rope._tables(positions), 64, rotary_dim)


def _decode_batch(backend_factory, lens: list[int], hq: int, hkv: int, d: int, seed: int,
                  kv_dtype: torch.dtype = torch.float32):
    """A decode batch over a KV pool (fp32 model, pool in `kv_dtype`) with random contents and
    scattered slots; returns (backend, batch, q, k, v, layer spec)."""
    gen = torch.Generator().manual_seed(seed)
    bs, slots = len(lens), sum(lens) + 8
    pool = KVPool(slots, 1, hkv, d, kv_dtype)
    pool.k_buffers[0].copy_(torch.randn(pool.k_buffers[0].shape, generator=gen))
    pool.v_buffers[0].copy_(torch.randn(pool.v_buffers[0].shape, generator=gen))
    table = ReqToTokenPool(bs + 1, max(lens) + 4)
    order = torch.randperm(slots, generator=gen)[: sum(lens)] + 1  # slot 0 is the reserved pad slot
    rows, offset = [], 0
    for n in lens:
        row = table.alloc()
        table.write(row, 0, order[offset : offset + n])
        rows.append(row)
        offset += n
    info = AttentionRunnerInfo(torch.device("cpu"), torch.float32, 1, hq, hkv, d, table, pool, bs, 4096)
    backend = backend_factory(info)
    last = torch.tensor([table.read(r, n)[-1].item() for r, n in zip(rows, lens, strict=True)])
    batch = ForwardBatch(
        mode=ForwardMode.DECODE, batch_size=bs, input_ids=torch.zeros(bs, dtype=torch.int64),
        positions=torch.tensor([n - 1 for n in lens]), req_pool_indices=torch.tensor(rows),
        seq_lens=torch.tensor(lens), prefix_lens=torch.tensor([n - 1 for n in lens]),
        extend_lens=torch.ones(bs, dtype=torch.int64), out_cache_loc=last, req_to_token_pool=table, kv_pool=pool,
        attn_backend=backend, seq_lens_cpu=list(lens), prefix_lens_cpu=[n - 1 for n in lens], extend_lens_cpu=[1] * bs,
    )
    q = torch.randn(bs, hq * d, generator=gen)
    k, v = torch.randn(bs, hkv * d, generator=gen), torch.randn(bs, hkv * d, generator=gen)
    layer = SimpleNamespace(layer_id=0, num_heads=hq, num_kv_heads=hkv, head_dim=d, scaling=d**-0.5)
    return backend, batch, q, k, v, layer


KV_DTYPES = [torch.float32, torch.bfloat16]  # the pool: the model's fp32, or runtime.kv_cache_dtype=bfloat16


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize(("hq", "hkv", "d"), [(9, 3, 64), (4, 4, 128), (8, 1, 64)])
def test_native_decode_attention_matches_the_sdpa_paths(hq, hkv, d, kv_dtype):
    lens = [1, 5, 37, 130, 2]
    outs = {}
    for name, factory in {
        "native": lambda info: CPUBatchedBackend(info),
        "padded": lambda info: CPUBatchedBackend(info, use_native=False),
    }.items():
        backend, batch, q, k, v, layer = _decode_batch(factory, lens, hq, hkv, d, seed=hq * d, kv_dtype=kv_dtype)
        assert backend.uses_native_kernel == (name == "native")
        backend.init_forward_metadata(batch)
        outs[name] = backend.forward_decode(q, k, v, layer, batch)
        stored_k, stored_v = (buf[0][batch.out_cache_loc] for buf in (batch.kv_pool.k_buffers, batch.kv_pool.v_buffers))
        # stored as KVPool.set_kv would (a bf16 pool: rounded to nearest even)
        assert torch.equal(stored_k, k.view(-1, hkv, d).to(kv_dtype)) and torch.equal(stored_v, v.view(-1, hkv, d).to(kv_dtype))
        # the reference: the torch_native per-request loop on the same pool (k, v already stored)
        ref_backend = CPUBatchedBackend(None)
        super(CPUBatchedBackend, ref_backend).init_forward_metadata(batch)
        outs["reference"] = ref_backend._attend(q, k, v, layer, batch)
    torch.testing.assert_close(outs["native"], outs["reference"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outs["padded"], outs["reference"], rtol=1e-5, atol=1e-5)


def _extend_batch(backend_factory, prefix_lens: list[int], extend_lens: list[int], hq: int, hkv: int, d: int,
                  seed: int, gen: torch.Generator, kv_dtype: torch.dtype = torch.float32):
    """_decode_batch's pool and slots turned into an EXTEND batch of these prefix and new-token counts, with
    random new q, k, v; returns (backend, batch, q, k, v, layer spec, the new tokens' slots)."""
    lens = [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)]
    backend, batch, *_ = _decode_batch(backend_factory, lens, hq, hkv, d, seed=seed, kv_dtype=kv_dtype)
    rows = batch.req_pool_indices.tolist()
    loc = torch.cat([batch.req_to_token_pool.read(r, n)[p:] for r, n, p in zip(rows, lens, prefix_lens, strict=True)])
    n = sum(extend_lens)
    batch.mode, batch.out_cache_loc = ForwardMode.EXTEND, loc
    batch.prefix_lens, batch.prefix_lens_cpu = torch.tensor(prefix_lens), list(prefix_lens)
    batch.extend_lens, batch.extend_lens_cpu = torch.tensor(extend_lens), list(extend_lens)
    q = torch.randn(n, hq * d, generator=gen)
    k, v = torch.randn(n, hkv * d, generator=gen), torch.randn(n, hkv * d, generator=gen)
    layer = SimpleNamespace(layer_id=0, num_heads=hq, num_kv_heads=hkv, head_dim=d, scaling=d**-0.5)
    return backend, batch, q, k, v, layer, loc


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize(("hq", "hkv", "d"), [(9, 3, 64), (4, 4, 128), (8, 1, 64)])
def test_native_extend_attention_matches_the_reference(hq, hkv, d, kv_dtype):
    """Prefill with and without a cached prefix, extends longer than one 16-query block, one of
    NATIVE_MAX_EXTEND (the per-row path of every build) and one past the build's limit (which must take
    the reference path), against torch_native's loop."""
    from radixserve_attention_cpu_batched.backend import NATIVE_MAX_EXTEND

    gen = torch.Generator().manual_seed(hq + d)
    limit = CPUBatchedBackend(AttentionRunnerInfo(torch.device("cpu"), torch.float32, 1, hq, hkv, d, ReqToTokenPool(2, 8),
                                                  KVPool(8, 1, hkv, d, kv_dtype), 2, 8)).max_native_extend
    assert limit >= NATIVE_MAX_EXTEND
    for prefix_lens, extend_lens in (([0, 7, 0, 40], [5, 1, 33, 17]), ([2, 0], [NATIVE_MAX_EXTEND, 9]), ([3], [limit + 1])):
        backend, batch, q, k, v, layer, loc = _extend_batch(lambda info: CPUBatchedBackend(info), prefix_lens,
                                                            extend_lens, hq, hkv, d, hq * d, gen, kv_dtype)
        assert backend.uses_native_kernel
        backend.init_forward_metadata(batch)
        assert (batch.attn_metadata is not None and not isinstance(batch.attn_metadata, list)) == (
            max(extend_lens) <= limit), "the native path applies exactly up to the build's limit"
        got = backend.forward_extend(q, k, v, layer, batch)
        stored_k, stored_v = (buf[0][loc] for buf in (batch.kv_pool.k_buffers, batch.kv_pool.v_buffers))
        assert torch.equal(stored_k, k.view(-1, hkv, d).to(kv_dtype)) and torch.equal(stored_v, v.view(-1, hkv, d).to(kv_dtype))
        ref_backend = CPUBatchedBackend(None)
        super(CPUBatchedBackend, ref_backend).init_forward_metadata(batch)
        torch.testing.assert_close(got, ref_backend._attend(q, k, v, layer, batch), rtol=1e-4, atol=1e-5)


def test_long_extends_take_the_flash_path_with_bf16_products():
    """runtime.cpu_matmul_precision=medium over a bf16 pool: a prompt longer than the per-row path takes (and
    a chunk after a cached prefix, beside a short request) goes through the native kernel, whose flash path
    does the long ones, instead of the SDPA reference path; it agrees with that path to bf16 rounding."""
    import dataclasses

    _attention_module("default", bf16_products=True)  # skips where the CPU has no AVX-512 BF16
    hq, hkv, d = 9, 3, 64
    limit = CPUBatchedBackend(AttentionRunnerInfo(torch.device("cpu"), torch.float32, 1, hq, hkv, d, ReqToTokenPool(2, 8),
                                                  KVPool(8, 1, hkv, d, torch.bfloat16), 2, 8)).max_native_extend
    prefix_lens, extend_lens = [0, 150, 4], [limit + 40, 120, 3]
    backend, batch, q, k, v, layer, _ = _extend_batch(
        lambda info: CPUBatchedBackend(dataclasses.replace(info, matmul_precision="medium")), prefix_lens, extend_lens,
        hq, hkv, d, 5, torch.Generator().manual_seed(6), torch.bfloat16)
    assert backend._bf16_products
    backend.init_forward_metadata(batch)
    assert not isinstance(batch.attn_metadata, list), "a long extend took the reference path"
    got = backend.forward_extend(q, k, v, layer, batch)
    ref_backend = CPUBatchedBackend(None)
    super(CPUBatchedBackend, ref_backend).init_forward_metadata(batch)
    want = ref_backend._attend(q, k, v, layer, batch)
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-2


# The attention builds this machine runs: the default one (AVX-512 score blocks and register value
# sums where the CPU has AVX-512) and, on such a CPU, the AVX2 loops of AVX2-only CPUs.
ATTENTION_BUILDS = ["default"] + (["avx2"] if _cpu_has_avx512() else [])


# (pool dtype, bf16 products): exact products over either pool, and the bf16 products of
# runtime.cpu_matmul_precision=medium over a bf16 pool (builds with AVX-512 BF16 only)
ATTENTION_MODES = [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)]
# (build, pool dtype, bf16 products): the AVX2 loops have no bf16 products
ATTENTION_CASES = [(build, kv, bf16) for build in ATTENTION_BUILDS for kv, bf16 in ATTENTION_MODES
                   if not (bf16 and build == "avx2")]


def _attention_module(build: str, bf16_products: bool = False):
    from radixserve_attention_cpu_batched.backend import _SOURCE, load_kernels

    if build == "default":
        module = load_kernels()
    else:
        module = native.load_extension("radixserve_cpu_attention_avx2", _SOURCE, defines=("RS_NO_AVX512",))
    if bf16_products and not module.bf16_products_available:
        pytest.skip("this CPU has no AVX-512 BF16: the attention build has no bf16 products")
    return module


@pytest.mark.parametrize(("build", "kv_dtype", "bf16_products"), ATTENTION_CASES)
@pytest.mark.parametrize("window", [0, 7])
def test_native_attention_row_is_the_same_bits_in_decode_and_extend(kv_dtype, bf16_products, build, window):
    """A query row's output does not depend on how many queries its call carries: the last row of an
    extend (a prefill, a speculative verify) equals a decode of that row bit for bit, with a sliding
    window too (later queries of an extend hide more keys than the first). Needed for speculative
    outputs to equal plain decoding where later layers amplify 1-ulp differences (int8 activation
    rounding of GGUF blocks kept quantized, bf16 matmul inputs or KV)."""
    kernels, gen = _attention_module(build, bf16_products), torch.Generator().manual_seed(0)
    hq, hkv, d, slots = 9, 3, 64, 80
    k_buf, v_buf = (torch.randn(slots, hkv, d, generator=gen).to(kv_dtype) for _ in range(2))
    table = torch.randperm(slots - 1, generator=gen)[None, :] + 1  # scattered slots; 0 is the pad slot
    row, none_b, none_i = torch.zeros(1, dtype=torch.int64), torch.empty(0, dtype=torch.bool), torch.empty(0, dtype=torch.int64)
    for seq_len, extend in ((5, 5), (23, 9), (40, 17), (61, 3)):  # ends inside and past a 16-query block
        q = torch.randn(extend, hq * d, generator=gen)
        loc = table[0, seq_len - extend : seq_len].contiguous()
        k_new, v_new = k_buf[loc].reshape(extend, -1).float(), v_buf[loc].reshape(extend, -1).float()
        ext = kernels.extend_attention(q, k_new, v_new, loc, k_buf, v_buf, table, row, torch.tensor([seq_len]),
                                       torch.tensor([extend]), none_b, none_i, none_i, d**-0.5, window, 0.0,
                                       bf16_products, 0)
        for i in range(extend):  # query i of the extend is a decode at sequence length seq_len - extend + i + 1
            one = kernels.decode_attention(q[i : i + 1].clone(), k_new[i : i + 1].clone(), v_new[i : i + 1].clone(),
                                           loc[i : i + 1].clone(), k_buf, v_buf, table, row,
                                           torch.tensor([seq_len - extend + i + 1]), d**-0.5, window, 0.0, bf16_products)
            assert torch.equal(one[0], ext[i]), f"seq_len {seq_len}, extend {extend}: query {i} differs"


def _exact_extend(q, k_buf, v_buf, slots, prefix, hq, d, window=0, cap=0.0):
    """float64 causal attention of one request's new tokens (positions prefix..) over its slots."""
    seq, ext, hkv = slots.numel(), q.shape[0], k_buf.shape[1]
    keys = k_buf[slots].double().repeat_interleave(hq // hkv, 1)
    values = v_buf[slots].double().repeat_interleave(hq // hkv, 1)
    s = torch.einsum("ihd,thd->hit", q.double().view(ext, hq, d), keys) * d**-0.5
    if cap:
        s = cap * torch.tanh(s / cap)
    q_pos, k_pos = torch.arange(prefix, seq)[:, None], torch.arange(seq)[None, :]
    visible = (k_pos <= q_pos) & ((k_pos > q_pos - window) if window else True)
    return torch.einsum("hit,thd->ihd", s.masked_fill(~visible, float("-inf")).softmax(-1), values).reshape(ext, -1)


@pytest.mark.parametrize(("hq", "hkv", "d"), [(9, 3, 64), (8, 2, 128), (2, 1, 256), (8, 8, 64), (32, 8, 128),
                                              (16, 1, 64), (20, 2, 64)])
@pytest.mark.parametrize(("window", "cap"), [(0, 0.0), (37, 0.0), (0, 20.0)])
def test_flash_extend_matches_exact_attention(hq, hkv, d, window, cap):
    """The tiled (flash) extend of bf16 products, which long prompts and chunks take: a batch of requests
    with and without a cached prefix, new tokens ending inside a 16-query vector, next to a short
    request on the per-row path, against float64 attention (windows and soft-capping too). Its error
    is the per-row path's (the same bf16 roundings of queries and weights), and the new K/V are stored."""
    kernels = _attention_module("default", bf16_products=True)
    gen = torch.Generator().manual_seed(hq * d + window)
    prefixes, extends = [0, 45, 130, 3], [70, 33, 100, 2]
    slots = sum(prefixes) + sum(extends) + 1
    k_buf, v_buf = (torch.randn(slots, hkv, d, generator=gen).bfloat16() for _ in range(2))
    order = torch.randperm(slots - 1, generator=gen) + 1  # scattered slots; 0 is the pad slot
    width = max(p + e for p, e in zip(prefixes, extends, strict=True))
    table, start, locs = torch.zeros(len(prefixes), width, dtype=torch.int64), 0, []
    for r, (p, e) in enumerate(zip(prefixes, extends, strict=True)):
        table[r, : p + e] = order[start : start + p + e]
        locs.append(table[r, p : p + e])
        start += p + e
    loc, n = torch.cat(locs).contiguous(), sum(extends)
    q = torch.randn(n, hq * d, generator=gen)
    k_new, v_new = torch.randn(n, hkv * d, generator=gen), torch.randn(n, hkv * d, generator=gen)
    none_b, none_i = torch.empty(0, dtype=torch.bool), torch.empty(0, dtype=torch.int64)
    rows, lens = torch.arange(len(prefixes)), torch.tensor([p + e for p, e in zip(prefixes, extends, strict=True)])

    def run(flash_min_extend: int) -> torch.Tensor:
        return kernels.extend_attention(q, k_new, v_new, loc, k_buf, v_buf, table, rows, lens, torch.tensor(extends),
                                        none_b, none_i, none_i, d**-0.5, window, cap, True, flash_min_extend)

    per_row, flash = run(0), run(16)  # 16: every request but the 2-token one takes the flash path
    assert torch.equal(k_buf[loc], k_new.view(n, hkv, d).bfloat16()) and torch.equal(v_buf[loc], v_new.view(n, hkv, d).bfloat16())
    assert not torch.equal(flash, per_row), "the flash path did not run"
    start = 0
    for r, (p, e) in enumerate(zip(prefixes, extends, strict=True)):
        exact = _exact_extend(q[start : start + e], k_buf, v_buf, table[r, : p + e], p, hq, d, window, cap)
        scale = exact.abs().max()
        err_flash = ((flash[start : start + e].double() - exact).abs().max() / scale).item()
        err_row = ((per_row[start : start + e].double() - exact).abs().max() / scale).item()
        assert err_flash < 1e-2 and err_flash <= 1.5 * err_row + 1e-3, (
            f"request {r} (prefix {p}, {e} new): flash error {err_flash:.2e}, per-row {err_row:.2e}")
        if e < 16:
            assert torch.equal(flash[start : start + e], per_row[start : start + e]), "a short request left the per-row path"
        start += e


def test_flash_extend_is_never_a_speculative_verify():
    """A speculative verify (num_draft_tokens + the verified token, as a chain without a tree mask) is
    shorter than FLASH_MIN_EXTEND, so its rows keep the per-row kernel's bits, which equal decode's."""
    from radixserve.config import SpeculativeSection
    from radixserve_attention_cpu_batched.backend import FLASH_MIN_EXTEND

    most_drafts = next(m.le for m in SpeculativeSection.model_fields["num_draft_tokens"].metadata if hasattr(m, "le"))
    assert FLASH_MIN_EXTEND > most_drafts + 1


@pytest.mark.parametrize(("build", "kv_dtype", "bf16_products"), ATTENTION_CASES)
def test_a_draft_tree_row_is_the_same_bits_as_decoding_its_path(kv_dtype, bf16_products, build):
    """A speculative verify of a draft tree: a node's row equals the decode of that node after its
    ancestors were accepted (the same keys, packed in order), bit for bit, though the tree places
    other branches' tokens between them."""
    kernels, gen = _attention_module(build, bf16_products), torch.Generator().manual_seed(2)
    hq, hkv, d, prefix, slots = 9, 3, 64, 21, 60
    k_buf, v_buf = (torch.randn(slots, hkv, d, generator=gen).to(kv_dtype) for _ in range(2))
    parents = [-1, 0, 0, 2, 1, 3, 3]  # node 5's path: 0, 2, 3, 5 (nodes 1 and 4 sit between them)
    e = len(parents)
    ancestors = []
    for node, parent in enumerate(parents):
        ancestors.append((ancestors[parent] if parent >= 0 else set()) | {node})
    mask = torch.tensor([[c in ancestors[a] for c in range(e)] for a in range(e)])
    order = torch.randperm(slots - 1, generator=gen) + 1
    table = order[None, : prefix + e].clone()
    loc = table[0, prefix:].contiguous()
    q = torch.randn(e, hq * d, generator=gen)
    k_new, v_new = k_buf[loc].reshape(e, -1).float(), v_buf[loc].reshape(e, -1).float()
    row = torch.zeros(1, dtype=torch.int64)
    ext = kernels.extend_attention(q, k_new, v_new, loc, k_buf, v_buf, table, row, torch.tensor([prefix + e]),
                                   torch.tensor([e]), mask.flatten(), torch.zeros(1, dtype=torch.int64),
                                   torch.empty(0, dtype=torch.int64), d**-0.5, 0, 0.0, bf16_products, 1)
    for node in range(e):
        path = sorted(ancestors[node])  # ancestors come before their descendants
        path_table = torch.cat([table[0, :prefix], loc[path]])[None, :]
        one = kernels.decode_attention(q[node : node + 1].clone(), k_new[node : node + 1].clone(),
                                       v_new[node : node + 1].clone(), loc[node : node + 1].clone(), k_buf, v_buf,
                                       path_table, row, torch.tensor([prefix + len(path)]), d**-0.5, 0, 0.0,
                                       bf16_products)
        assert torch.equal(one[0], ext[node]), f"node {node} (path {path}) differs from its decode"


@pytest.mark.parametrize(("build", "kv_dtype", "bf16_products"), ATTENTION_CASES)
@pytest.mark.parametrize(("hq", "hkv", "d"), [(9, 3, 64), (8, 2, 128), (2, 1, 256), (8, 1, 64)])
def test_native_decode_row_alone_is_the_same_bits_as_in_a_batch(build, hq, hkv, d, kv_dtype, bf16_products):
    """A request's decode output does not depend on the other rows of its batch (bit for bit), and
    matches an fp64 softmax of the stored keys and values where scores span far more than fp32's exp
    range (row 2: keys more than 87 below the max weigh exactly 0 in the kernel's vectorized exp):
    to 1e-5 with exact products, to the bf16 rounding of queries and weights with bf16 products,
    which must differ from the exact ones (the option is not ignored)."""
    kernels, gen = _attention_module(build, bf16_products), torch.Generator().manual_seed(1)
    lens = [1, 9, 45, 33]
    slots = sum(lens) + 1
    k_buf, v_buf = (torch.randn(slots, hkv, d, generator=gen).to(kv_dtype) for _ in range(2))
    table = torch.zeros(len(lens), max(lens), dtype=torch.int64)
    order, start = torch.randperm(slots - 1, generator=gen) + 1, 0  # scattered slots; 0 is the pad slot
    for b, n in enumerate(lens):
        table[b, :n] = order[start : start + n]
        start += n
    q = torch.randn(len(lens), hq * d, generator=gen)
    q[2] *= 40.0  # scores spread over hundreds: most exps underflow
    loc = torch.tensor([table[b, n - 1].item() for b, n in enumerate(lens)])
    k_new, v_new = (buf[loc].reshape(len(lens), -1).float() for buf in (k_buf, v_buf))
    rows, seq = torch.arange(len(lens)), torch.tensor(lens)
    batch = kernels.decode_attention(q, k_new, v_new, loc, k_buf, v_buf, table, rows, seq, d**-0.5, 0, 0.0,
                                     bf16_products)
    if bf16_products:
        exact = kernels.decode_attention(q, k_new, v_new, loc, k_buf, v_buf, table, rows, seq, d**-0.5, 0, 0.0, False)
        assert not torch.equal(batch, exact), "bf16 products gave the exact products' bits"
    for b, n in enumerate(lens):
        one = kernels.decode_attention(q[b : b + 1].clone(), k_new[b : b + 1].clone(), v_new[b : b + 1].clone(),
                                       loc[b : b + 1].clone(), k_buf, v_buf, table[b : b + 1].clone(),
                                       torch.zeros(1, dtype=torch.int64), seq[b : b + 1].clone(), d**-0.5, 0, 0.0,
                                       bf16_products)
        assert torch.equal(one[0], batch[b]), f"row {b} differs alone"
        keys = k_buf[table[b, :n]].double().repeat_interleave(hq // hkv, dim=1)  # [n, hq, d]
        values = v_buf[table[b, :n]].double().repeat_interleave(hq // hkv, dim=1)
        weights = torch.softmax(torch.einsum("hd,nhd->hn", q[b].double().view(hq, d), keys) * d**-0.5, dim=-1)
        ref = torch.einsum("hn,nhd->hd", weights, values).reshape(-1)
        if bf16_products:  # queries and weights rounded to 8 significant bits (row 2's scores span hundreds)
            assert (batch[b].double() - ref).norm() <= 1e-2 * ref.norm(), f"row {b} is not attention"
        else:
            torch.testing.assert_close(batch[b].double(), ref, rtol=1e-5, atol=1e-5)


def test_native_kernel_is_skipped_where_it_does_not_apply():
    backend, *_ = _decode_batch(lambda info: CPUBatchedBackend(info), [3], 4, 2, 16, seed=0)
    assert not backend.uses_native_kernel  # head_dim 16 is not compiled


def test_native_can_be_switched_off(monkeypatch, tmp_path):
    monkeypatch.setenv("RADIXSERVE_NATIVE", "0")
    monkeypatch.setattr(native, "_loaded", {})
    assert native.load_extension("radixserve_cpu_ops", cpu_ops._SOURCE) is None


@pytest.mark.parametrize(("rows", "inter"), [(1, 50), (64, 1536), (300, 72)])
def test_gate_up_with_silu_in_the_gemm_epilogue(rows, inter):
    """A [gate; up] projection packed for SiluAndMul gives SiluAndMul(x @ W^T) from one kernel,
    also where |gate| is large enough that exp(-gate) overflows fp32 (no NaN)."""
    from radixserve.layers.linear import MergedColumnParallelLinear

    gen = torch.Generator().manual_seed(rows)
    layer = MergedColumnParallelLinear(40, [inter, inter], fuse_silu_and_mul=True)
    layer.weight.data.copy_(torch.randn(2 * inter, 40, generator=gen))
    layer.quant_method.process_weights_after_loading(layer)
    assert layer.packed_weight.silu_gated
    for scale in (1.0, 300.0):
        x = scale * torch.randn(rows, 40, generator=gen)
        want = SiluAndMul()(F.linear(x, layer.weight))
        got = layer.forward_silu_and_mul(x)
        assert not got.isnan().any()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-3 * scale)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight))  # the plain forward still works
    with pytest.raises(ValueError, match="two equal output sizes"):
        MergedColumnParallelLinear(40, [inter, inter + 1], fuse_silu_and_mul=True)


def _greedy_run(path: str) -> dict:
    """Greedy tokens of a tiny model, and whether its GEMM and attention used the native kernels.
    Runs in this process (kernels on, as conftest built them) and, with RADIXSERVE_NATIVE=0, in a
    child process (`python -c` of this function's source): the switch is read when the model is built."""
    from radixserve.config import Config
    from radixserve.model_runner import ModelRunner
    from runner_driver import greedy_generate

    cfg = Config.build({"model": {"path": path}, "runtime": {"device": "cpu", "dtype": "float32", "num_threads": 1},
                        "scheduler": {"max_total_tokens": 2048, "max_running_requests": 8}})
    runner = ModelRunner(cfg, show_progress=False)
    packed = runner.model.model.layers[0].mlp.gate_up_proj.packed_weight
    out = greedy_generate(runner, [[5, 9, 2, 7, 11], [3] * 30, [8, 1]], 12)
    return {"tokens": [g.tokens for g in out], "native": packed.panels is not None,
            "attention_native": runner.attn_backend.uses_native_kernel}


def test_outputs_are_the_same_with_the_native_kernels_off(tiny_llama_dir):
    """RADIXSERVE_NATIVE=0 (the path of a machine without a compiler) gives the same greedy tokens."""
    import json
    import os
    import subprocess
    import sys

    path = tiny_llama_dir("llama", head_dim=64, num_attention_heads=4, num_key_value_heads=2, hidden_size=128)
    assert native.enabled(), "RADIXSERVE_NATIVE=0 is set for the whole test run"
    runs = {"1": _greedy_run(path)}  # in this process: one interpreter start fewer
    tests = os.path.dirname(__file__)
    script = (f"import json, sys\nsys.path.insert(0, {tests!r})\nfrom test_native_cpu_kernels import _greedy_run\n"
              f"print(json.dumps(_greedy_run({path!r})))")
    env = {**os.environ, "RADIXSERVE_NATIVE": "0"}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    runs["0"] = json.loads(proc.stdout.strip().splitlines()[-1])
    assert runs["1"]["native"] and runs["1"]["attention_native"]
    assert not runs["0"]["native"] and not runs["0"]["attention_native"]
    assert runs["1"]["tokens"] == runs["0"]["tokens"]
