"""KV memory bookkeeping: every slot and row accounted for."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from radixserve.memory import KVPool, ReqToTokenPool, TokenAllocator, kv_bytes_per_token, tokens_for_budget


def test_allocator_hands_out_distinct_slots_and_refuses_when_short():
    a = TokenAllocator(10, debug_checks=True)
    x = a.alloc(4)
    y = a.alloc(6)
    assert x.dtype == torch.int64 and x.device.type == "cpu"
    slots = torch.cat([x, y]).tolist()
    assert sorted(slots) == list(range(1, 11)), "slot 0 is reserved; 1..size handed out once each"
    assert a.available_size() == 0
    assert a.alloc(1) is None and a.available_size() == 0
    a.free(x)
    assert a.available_size() == 4
    assert a.alloc(5) is None, "refusal must not change the free count"
    z = a.alloc(4)
    assert sorted(z.tolist()) == sorted(x.tolist())
    a.free(y)
    a.free(z)
    assert a.available_size() == a.size


def test_allocator_detects_double_free():
    a = TokenAllocator(8, debug_checks=True)
    x = a.alloc(3)
    a.free(x)
    with pytest.raises(ValueError, match="double free"):
        a.free(x[:1])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(min_value=0, max_value=12)), max_size=40))
def test_allocator_accounting_property(ops):
    """Any sequence of allocs/frees: held + free == size, no slot held twice, all back at the end."""
    a = TokenAllocator(32, debug_checks=True)
    held: list[torch.Tensor] = []
    for is_alloc, n in ops:
        if is_alloc or not held:
            got = a.alloc(n)
            if got is None:
                assert n > a.available_size()
            else:
                held.append(got)
        else:
            a.free(held.pop(n % len(held)))
        flat = torch.cat(held).tolist() if held else []
        assert len(flat) == len(set(flat)) and all(1 <= s <= 32 for s in flat)
        assert len(flat) + a.available_size() == a.size
    for h in held:
        a.free(h)
    assert a.available_size() == a.size


def test_req_to_token_rows():
    pool = ReqToTokenPool(3, 16)
    rows = [pool.alloc() for _ in range(3)]
    assert sorted(rows) == [0, 1, 2] and pool.alloc() is None
    pool.write(rows[1], 0, torch.tensor([5, 6, 7]))
    pool.write(rows[1], 3, torch.tensor([9]))
    assert pool.req_to_token[rows[1], :4].tolist() == [5, 6, 7, 9]
    with pytest.raises(ValueError, match="context length"):
        pool.write(rows[0], 15, torch.tensor([1, 2]))
    pool.free(rows[1])
    with pytest.raises(ValueError, match="not allocated"):
        pool.free(rows[1])
    assert pool.available_size() == 1 and pool.alloc() == rows[1]


def test_kv_pool_writes_only_the_given_slots():
    pool = KVPool(num_slots=6, num_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.float32)
    k = torch.randn(2, 8)
    v = torch.randn(2, 2, 4)
    pool.set_kv(1, torch.tensor([3, 5]), k, v)
    kb, vb = pool.get_kv(1)
    assert kb.shape == (7, 2, 4)
    torch.testing.assert_close(kb[[3, 5]], k.view(2, 2, 4))
    torch.testing.assert_close(vb[[3, 5]], v)
    untouched = [0, 1, 2, 4, 6]
    assert kb[untouched].abs().sum() == 0 and pool.get_kv(0)[0].abs().sum() == 0


def test_tokens_for_budget():
    per = kv_bytes_per_token(30, 3, 64, torch.float32)
    assert per == 2 * 30 * 3 * 64 * 4
    assert tokens_for_budget(per * 100 + per // 2, 30, 3, 64, torch.float32) == 100
    assert tokens_for_budget(per * 100, 30, 3, 64, torch.bfloat16) == 200


def test_req_to_token_host_mirror_serves_reads_without_the_device():
    """Off CPU the pool keeps a host copy of the table; reads come from it (no device sync).
    The 'meta' device stands in for a GPU: its table holds no data, so only the mirror can answer."""
    pool = ReqToTokenPool(4, 16, device="meta")
    assert pool.host is not pool.req_to_token and pool.host.device.type == "cpu"
    row = pool.alloc()
    pool.write(row, 0, torch.tensor([5, 6, 7]))
    pool.write_positions([row], [3], torch.tensor([9]))
    assert pool.read(row, 4).tolist() == [5, 6, 7, 9]
    assert pool.read(row, 4, start=2).tolist() == [7, 9]
    cpu = ReqToTokenPool(2, 8)
    assert cpu.host is cpu.req_to_token  # on CPU the table is its own mirror


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def test_cpu_kv_pool_memory_becomes_resident_only_as_slots_are_written():
    """A CPU pool sized for the worst case costs resident memory for the slots used, not its size;
    every slot still reads as zero until written (slot 0, the padding slot, included)."""
    before = _rss_mb()
    pool = KVPool(num_slots=65536, num_layers=4, num_kv_heads=2, head_dim=64, dtype=torch.float32)
    assert pool.nbytes() > 250 * 2**20
    assert _rss_mb() - before < 16, "allocating the pool must not make its pages resident"
    slots = torch.arange(1, 2049)  # 2048 slots x 512 B per buffer: 1 MB per buffer written
    for layer in range(4):
        pool.set_kv(layer, slots, torch.ones(2048, 2, 64), torch.ones(2048, 2, 64))
    grown = _rss_mb() - before
    assert 7 < grown < 24, f"8 MB written should add about 8 MB, added {grown:.1f} MB"
    k, v = pool.get_kv(3)
    assert k[0].abs().sum() == 0 and v[2049:].abs().sum() == 0 and k[1:2049].sum() == 2048 * 128


def test_allocator_reuses_freed_slots_before_untouched_ones():
    a = TokenAllocator(100, debug_checks=True)
    first = a.alloc(10)
    assert first.tolist() == list(range(1, 11)), "untouched slots go lowest first"
    a.free(first[:4])
    again = a.alloc(6)
    assert sorted(again[:4].tolist()) == [1, 2, 3, 4] and again[4:].tolist() == [11, 12]
