"""cpu_batched decode must equal the reference torch_native backend (outputs and KV writes)."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from radixserve.memory import KVPool, ReqToTokenPool
from radixserve.state import ForwardBatch, ForwardMode
from radixserve_attention_cpu_batched.backend import CPUBatchedBackend
from radixserve_attention_torch_native.backend import TorchNativeBackend


def decode_batch(backend, seq_lens, hq, hkv, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    bs, slots_total = len(seq_lens), sum(seq_lens) + 8
    pool = ReqToTokenPool(bs + 2, max(seq_lens) + 4)
    kv = KVPool(slots_total, num_layers=1, num_kv_heads=hkv, head_dim=d, dtype=torch.float32)
    kv.k_buffers[0].normal_(generator=g)
    kv.v_buffers[0].normal_(generator=g)
    perm = torch.randperm(slots_total, generator=g)[: sum(seq_lens)] + 1  # scattered slots, never 0
    rows, out_loc, start = [], [], 0
    for i, n in enumerate(seq_lens):
        row = i + 1  # rows need not start at 0
        pool.req_to_token[row, :n] = perm[start : start + n]
        pool.req_to_token[row, n:] = 7  # stale garbage beyond the request's length must be ignored
        rows.append(row)
        out_loc.append(int(perm[start + n - 1]))
        start += n
    batch = ForwardBatch(
        mode=ForwardMode.DECODE,
        batch_size=bs,
        input_ids=torch.zeros(bs, dtype=torch.int64),
        positions=torch.tensor([n - 1 for n in seq_lens]),
        req_pool_indices=torch.tensor(rows),
        seq_lens=torch.tensor(seq_lens),
        prefix_lens=torch.tensor([n - 1 for n in seq_lens]),
        extend_lens=torch.ones(bs, dtype=torch.int64),
        out_cache_loc=torch.tensor(out_loc),
        req_to_token_pool=pool,
        kv_pool=kv,
        attn_backend=backend,
        seq_lens_cpu=list(seq_lens),
        prefix_lens_cpu=[n - 1 for n in seq_lens],
        extend_lens_cpu=[1] * bs,
    )
    q = torch.randn(bs, hq * d, generator=g)
    k = torch.randn(bs, hkv * d, generator=g)
    v = torch.randn(bs, hkv * d, generator=g)
    layer = SimpleNamespace(layer_id=0, num_heads=hq, num_kv_heads=hkv, head_dim=d, scaling=d**-0.5)
    return batch, q, k, v, layer


@pytest.mark.parametrize("hq,hkv", [(9, 3), (4, 4), (8, 1)])
def test_batched_decode_matches_the_reference(hq, hkv):
    seq_lens = [1, 5, 17, 3, 40, 2]
    ref_backend, new_backend = TorchNativeBackend(), CPUBatchedBackend()
    batch, q, k, v, layer = decode_batch(ref_backend, seq_lens, hq, hkv, 16)
    batch2 = copy.copy(batch)
    batch2.kv_pool = copy.deepcopy(batch.kv_pool)
    batch2.attn_backend = new_backend
    ref_backend.init_forward_metadata(batch)
    new_backend.init_forward_metadata(batch2)
    want = ref_backend.forward_decode(q, k, v, layer, batch)
    got = new_backend.forward_decode(q, k, v, layer, batch2)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(batch2.kv_pool.k_buffers[0], batch.kv_pool.k_buffers[0], rtol=0, atol=0)
    torch.testing.assert_close(batch2.kv_pool.v_buffers[0], batch.kv_pool.v_buffers[0], rtol=0, atol=0)
