"""torch_native attention against a from-scratch reference: cached prefix + causal new tokens, GQA."""

from __future__ import annotations

import math

import pytest
import torch
from radixserve.layers.attention import RadixAttention
from radixserve.memory import KVPool, ReqToTokenPool
from radixserve.state import ForwardBatch, ForwardMode
from radixserve_attention_torch_native.backend import TorchNativeBackend

HQ, HKV, D = 4, 2, 8


def reference(q, k, v, scale):
    """q [n, HQ, D] at the last n positions of k/v [L, HKV, D]; causal."""
    n, L = q.shape[0], k.shape[0]
    k = k.repeat_interleave(HQ // HKV, dim=1)
    v = v.repeat_interleave(HQ // HKV, dim=1)
    out = torch.empty_like(q)
    for i in range(n):
        pos = L - n + i
        s = torch.einsum("hd,lhd->hl", q[i], k[: pos + 1]) * scale
        out[i] = torch.einsum("hl,lhd->hd", s.softmax(-1), v[: pos + 1])
    return out


@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.DECODE])
def test_matches_reference_with_prefix(mode):
    gen = torch.Generator().manual_seed(0)
    prefix_lens = [0, 5, 3]
    extend_lens = [4, 3, 1] if mode is ForwardMode.EXTEND else [1, 1, 1]
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)]
    kv = KVPool(num_slots=40, num_layers=1, num_kv_heads=HKV, head_dim=D, dtype=torch.float32)
    r2t = ReqToTokenPool(4, 32)
    # each request's full K/V, scattered over non-contiguous slots
    perm = (torch.randperm(40, generator=gen) + 1).tolist()
    full_k = [torch.randn(s, HKV, D, generator=gen) for s in seq_lens]
    full_v = [torch.randn(s, HKV, D, generator=gen) for s in seq_lens]
    rows, out_loc = [2, 0, 3], []
    for i, s in enumerate(seq_lens):
        slots = torch.tensor([perm.pop() for _ in range(s)])
        r2t.write(rows[i], 0, slots)
        p = prefix_lens[i]
        kv.set_kv(0, slots[:p], full_k[i][:p], full_v[i][:p])  # cached prefix
        out_loc.append(slots[p:])
    before_k = kv.k_buffers[0].clone()
    q = [torch.randn(e, HQ, D, generator=gen) for e in extend_lens]
    new_k = torch.cat([k[p:] for k, p in zip(full_k, prefix_lens, strict=True)])
    new_v = torch.cat([v[p:] for v, p in zip(full_v, prefix_lens, strict=True)])
    backend = TorchNativeBackend()
    n = sum(extend_lens)
    batch = ForwardBatch(
        mode=mode, batch_size=3, input_ids=torch.zeros(n, dtype=torch.int64), positions=torch.zeros(n, dtype=torch.int64),
        req_pool_indices=torch.tensor(rows), seq_lens=torch.tensor(seq_lens), prefix_lens=torch.tensor(prefix_lens),
        extend_lens=torch.tensor(extend_lens), out_cache_loc=torch.cat(out_loc), req_to_token_pool=r2t, kv_pool=kv,
        attn_backend=backend, seq_lens_cpu=seq_lens, prefix_lens_cpu=prefix_lens, extend_lens_cpu=extend_lens,
    )
    backend.init_forward_metadata(batch)
    layer = RadixAttention(0, HQ, HKV, D, 1 / math.sqrt(D))
    out = layer(torch.cat(q).reshape(n, -1), new_k.reshape(n, -1), new_v.reshape(n, -1), batch)
    assert out.shape == (n, HQ * D)
    want = torch.cat([reference(qi, k, v, 1 / math.sqrt(D)) for qi, k, v in zip(q, full_k, full_v, strict=True)])
    torch.testing.assert_close(out.view(n, HQ, D), want, rtol=1e-5, atol=1e-5)
    # new KV landed in out_cache_loc; no other slot changed
    torch.testing.assert_close(kv.k_buffers[0][batch.out_cache_loc], new_k)
    changed = (kv.k_buffers[0] != before_k).flatten(1).any(1).nonzero().flatten()
    assert set(changed.tolist()) <= set(batch.out_cache_loc.tolist())


def test_registered_as_default_cpu_backend():
    from radixserve.plugins.registry import Registry

    reg = Registry.discover()
    assert reg.load("attention", "torch_native") is TorchNativeBackend
    assert reg.get("attention", "torch_native").supports_device("cpu")
