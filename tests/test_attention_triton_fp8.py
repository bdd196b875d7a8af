"""The triton backend's kernels on an FP8 (float8_e4m3fn) KV pool against torch_native on the same pool.

Both backends see identical pool bytes (the prefix is stored through `KVPool.set_kv` into two pools
built alike) and store the new tokens through the same quantizer, so they attend the same real
values: the only differences left are summation order, hence a tight tolerance. Without a GPU the
kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1, float32 activations; the interpreter
loads float8_e4m3fn tensors and widens them exactly, which the pool-dtype and result checks below
depend on). Scales differ from 1 and some values saturate, so the in-kernel scaling and the clamp
are both exercised. torch-only imports: the module also runs on the bare GPU image."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from triton_interpret import use_interpreter_without_gpu

ON_GPU, _restore_interpret = use_interpreter_without_gpu()  # must precede the kernels' @triton.jit decoration
_restore_triton_interpret = pytest.fixture(autouse=True, scope="module")(_restore_interpret)

from radixserve.memory.kv_pool import KVPool  # noqa: E402
from radixserve.memory.req_to_token import ReqToTokenPool  # noqa: E402
from radixserve.state import ForwardBatch, ForwardMode  # noqa: E402
from radixserve_attention_torch_native.backend import TorchNativeBackend  # noqa: E402
from radixserve_attention_triton.backend import TritonAttentionBackend  # noqa: E402

DEVICE = "cuda" if ON_GPU else "cpu"
DTYPE = torch.bfloat16 if ON_GPU else torch.float32  # the interpreter's bf16 dots are wrong: fp32 there
TOL = 2e-2 if ON_GPU else 1e-4  # relative (Frobenius) error vs torch_native on the same fp8 pool
K_SCALE, V_SCALE = 0.02, 0.05  # values reach ~4.5 / 0.02 = 225 and ~4.5 / 0.05 = 90 stored: inside e4m3
LAYER_ID = 1


def _layer(h: int, kvh: int, d: int, window: int | None = None, cap: float | None = None):
    return SimpleNamespace(layer_id=LAYER_ID, num_heads=h, num_kv_heads=kvh, head_dim=d, scaling=d**-0.5,
                           sliding_window=window, logit_cap=cap)


def _setup(prefix_lens, extend_lens, h, kvh, d, mode, seed=0, big=False):
    """Twin (pool, batch) pairs, one per backend, with identical stored prefixes; q, k, v of the new tokens."""
    gen = torch.Generator().manual_seed(seed)
    bs = len(prefix_lens)
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)]
    num_slots = sum(seq_lens) + 5
    perm = (torch.randperm(num_slots, generator=gen) + 1).tolist()
    rows = torch.randperm(bs + 2, generator=gen)[:bs].tolist()
    ks = [torch.randn(n, kvh, d, generator=gen) for n in seq_lens]
    vs = [torch.randn(n, kvh, d, generator=gen) for n in seq_lens]
    if big:  # a few keys past 448 * k_scale: stored saturated, on both sides alike
        ks[0][0, 0, :4] = 40.0
    twins = []
    for backend_cls in (TritonAttentionBackend, TorchNativeBackend):
        pool = KVPool(num_slots, 2, kvh, d, torch.float8_e4m3fn, DEVICE, k_scales=[1.0, K_SCALE],
                      v_scales=[1.0, V_SCALE])
        r2t = ReqToTokenPool(bs + 2, max(seq_lens) + 3, DEVICE)
        out_loc, cursor = [], 0
        for i in range(bs):
            slots = torch.tensor(perm[cursor : cursor + seq_lens[i]], dtype=torch.int64)
            cursor += seq_lens[i]
            r2t.write(rows[i], 0, slots)
            p = prefix_lens[i]
            if p:
                pool.set_kv(LAYER_ID, slots[:p].to(DEVICE), ks[i][:p].to(DEVICE, DTYPE), vs[i][:p].to(DEVICE, DTYPE))
            out_loc.append(slots[p:])
        info = SimpleNamespace(device=DEVICE, dtype=DTYPE, num_heads=h, num_kv_heads=kvh, head_dim=d, max_bs=bs,
                               req_to_token_pool=r2t, kv_pool=pool)
        backend = backend_cls(info)

        def dev(xs):
            return torch.tensor(xs, dtype=torch.int64, device=DEVICE)

        batch = ForwardBatch(
            mode=mode, batch_size=bs, input_ids=torch.zeros(sum(extend_lens), dtype=torch.int64, device=DEVICE),
            positions=torch.cat([torch.arange(p, p + e) for p, e in zip(prefix_lens, extend_lens)]).to(DEVICE),
            req_pool_indices=dev(rows), seq_lens=dev(seq_lens), prefix_lens=dev(prefix_lens),
            extend_lens=dev(extend_lens), out_cache_loc=torch.cat(out_loc).to(DEVICE), req_to_token_pool=r2t,
            kv_pool=pool, attn_backend=backend, seq_lens_cpu=list(seq_lens), prefix_lens_cpu=list(prefix_lens),
            extend_lens_cpu=list(extend_lens),
        )
        twins.append((backend, batch))
    k_new = torch.cat([k[p:] for k, p in zip(ks, prefix_lens)]).reshape(-1, kvh * d).to(DEVICE, DTYPE)
    v_new = torch.cat([v[p:] for v, p in zip(vs, prefix_lens)]).reshape(-1, kvh * d).to(DEVICE, DTYPE)
    q = torch.randn(sum(extend_lens), h * d, generator=gen).to(DEVICE, DTYPE)
    return twins, q, k_new, v_new


def _compare(twins, q, k, v, layer):
    outs, pools = [], []
    for backend, batch in twins:
        assert batch.kv_pool.get_kv(LAYER_ID)[0].dtype == torch.float8_e4m3fn  # the kernels read fp8, not a copy
        backend.init_forward_metadata(batch)
        outs.append(backend.forward(q, k, v, layer, batch).float())
        pools.append(batch.kv_pool.get_kv(LAYER_ID))
    got, want = outs
    assert torch.isfinite(got).all()
    rel = ((got - want).norm() / want.norm()).item()
    assert rel < TOL, f"triton vs torch_native on the same fp8 pool: relative error {rel:.2e} >= {TOL:.0e}"
    # both stored the new tokens as the same fp8 bytes
    for a, b in zip(pools[0], pools[1], strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("h,kvh,d", [(4, 1, 64), (2, 2, 32)])
@pytest.mark.parametrize("seqs", [[1, 20, 70], [33]])
def test_decode_kernel_on_fp8_pool_matches_torch_native(h, kvh, d, seqs):
    twins, q, k, v = _setup([s - 1 for s in seqs], [1] * len(seqs), h, kvh, d, ForwardMode.DECODE, big=True)
    _compare(twins, q, k, v, _layer(h, kvh, d))


@pytest.mark.parametrize("prefix_lens,extend_lens", [([17, 0, 5], [16, 21, 2]), ([40], [1])])
def test_extend_kernel_on_fp8_pool_matches_torch_native(prefix_lens, extend_lens):
    twins, q, k, v = _setup(prefix_lens, extend_lens, 4, 2, 32, ForwardMode.EXTEND, seed=1, big=True)
    _compare(twins, q, k, v, _layer(4, 2, 32))


def test_fresh_prompt_prefill_attends_the_stored_fp8_values():
    """A batch of fresh prompts runs SDPA on the new tokens without reading the pool: it must still
    see them as stored (dequantized), like torch_native and every later step."""
    twins, q, k, v = _setup([0, 0], [9, 20], 4, 2, 32, ForwardMode.EXTEND, seed=2)
    _compare(twins, q, k, v, _layer(4, 2, 32))


def test_fp8_kernels_with_window_and_soft_cap():
    twins, q, k, v = _setup([30, 3], [5, 1], 2, 1, 32, ForwardMode.EXTEND, seed=3)
    _compare(twins, q, k, v, _layer(2, 1, 32, window=8, cap=5.0))
    twins, q, k, v = _setup([44, 9], [1, 1], 2, 1, 32, ForwardMode.DECODE, seed=4)
    _compare(twins, q, k, v, _layer(2, 1, 32, window=8, cap=5.0))


def test_kernels_refuse_mixed_fp8_and_float_inputs():
    from radixserve_attention_triton.extend_kernel import extend_attention

    k_buf = torch.zeros(4, 1, 16, dtype=torch.float8_e4m3fn)
    q = torch.zeros(1, 1, 16)
    z = torch.zeros(1, dtype=torch.int64)
    with pytest.raises(ValueError, match="fp8 KV pool needs float8_e4m3fn"):
        extend_attention(q, q, q, q.clone(), k_buf, k_buf, torch.zeros(1, 4, dtype=torch.int64), z, z, z + 1, z, 1,
                         1.0, interpret=True)


def test_chunked_prefill_equals_whole_prefill_on_fp8_pool():
    """The new tokens are attended as stored (fp8), so a prompt prefilled whole (fresh-prompt SDPA path)
    and the same prompt's second half prefilled over its cached first half (the extend kernel reading
    the fp8 prefix) give the second half the same outputs."""
    gen = torch.Generator().manual_seed(5)
    h, kvh, d, n, half = 4, 2, 32, 24, 12
    q = torch.randn(n, h * d, generator=gen).to(DEVICE, DTYPE)
    k = torch.randn(n, kvh * d, generator=gen).to(DEVICE, DTYPE)
    v = torch.randn(n, kvh * d, generator=gen).to(DEVICE, DTYPE)
    layer = _layer(h, kvh, d)

    def run(prefix: int) -> torch.Tensor:
        pool = KVPool(n + 2, 2, kvh, d, torch.float8_e4m3fn, DEVICE, k_scales=[1.0, K_SCALE], v_scales=[1.0, V_SCALE])
        r2t = ReqToTokenPool(2, n + 2, DEVICE)
        slots = torch.arange(1, n + 1)
        r2t.write(0, 0, slots)
        pool.set_kv(LAYER_ID, slots[:prefix].to(DEVICE), k[:prefix], v[:prefix])
        backend = TritonAttentionBackend(SimpleNamespace(device=DEVICE, dtype=DTYPE, num_heads=h, num_kv_heads=kvh,
                                                         head_dim=d, max_bs=1, req_to_token_pool=r2t, kv_pool=pool))
        one = torch.tensor([0], dtype=torch.int64, device=DEVICE)
        batch = ForwardBatch(
            mode=ForwardMode.EXTEND, batch_size=1, input_ids=torch.zeros(n - prefix, dtype=torch.int64, device=DEVICE),
            positions=torch.arange(prefix, n, device=DEVICE), req_pool_indices=one, seq_lens=one + n,
            prefix_lens=one + prefix, extend_lens=one + n - prefix, out_cache_loc=slots[prefix:].to(DEVICE),
            req_to_token_pool=r2t, kv_pool=pool, attn_backend=backend, seq_lens_cpu=[n], prefix_lens_cpu=[prefix],
            extend_lens_cpu=[n - prefix],
        )
        backend.init_forward_metadata(batch)
        assert (batch.attn_metadata.fresh_prompt_lens is not None) == (prefix == 0)  # SDPA path vs the kernel
        return backend.forward(q[prefix:], k[prefix:], v[prefix:], layer, batch).float()

    whole, chunked = run(0)[half:], run(half)
    rel = ((whole - chunked).norm() / whole.norm()).item()
    assert rel < TOL, f"chunked vs whole prefill on an fp8 pool: relative error {rel:.2e}"
