"""The MTP layer's own latent KV memory: a one-layer `LatentKVPool` (radixserve.memory) shared by
every request, growing on demand; each request holds the slots of its verified positions until it
finishes."""

from __future__ import annotations

import torch
from radixserve.memory.latent_pool import LatentKVPool


class DraftLatentPool:
    """Slots 1..capacity of a one-layer LatentKVPool (slot 0 stays the pool's padding slot)."""

    def __init__(self, kv_lora_rank: int, rope_dim: int, dtype: torch.dtype, device: torch.device,
                 capacity: int = 1024) -> None:
        self.kv_lora_rank, self.rope_dim = kv_lora_rank, rope_dim
        self.dtype, self.device = dtype, torch.device(device)
        self.pool = LatentKVPool(capacity, 1, kv_lora_rank, rope_dim, dtype, self.device)
        self._free = list(range(capacity, 0, -1))  # a stack: low slots first

    @property
    def capacity(self) -> int:
        return self.pool.num_slots

    @property
    def rows(self) -> torch.Tensor:
        """`[capacity + 1, kv_lora_rank + rope_dim]`: row s is slot s's c_kv then k_pe."""
        return self.pool.get_latent(0)

    def free_slots(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> torch.Tensor:
        """`n` slots (int64, on the pool's device); the pool doubles when it runs out."""
        while len(self._free) < n:
            self._grow()
        got = [self._free.pop() for _ in range(n)]
        return torch.tensor(got, dtype=torch.int64, device=self.device)

    def write(self, slots: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor) -> None:
        self.pool.set_latent(0, slots, c_kv, k_pe)

    def free(self, slots: torch.Tensor) -> None:
        self._free.extend(reversed(slots.tolist()))

    def _grow(self) -> None:
        old = self.capacity
        bigger = LatentKVPool(2 * old, 1, self.kv_lora_rank, self.rope_dim, self.dtype, self.device)
        bigger.get_latent(0)[: old + 1] = self.rows
        self.pool = bigger
        self._free[:0] = list(range(2 * old, old, -1))
