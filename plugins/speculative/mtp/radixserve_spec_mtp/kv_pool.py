"""The MTP layer's own latent KV memory: a one-layer `LatentKVPool` (radixserve.memory) shared by
every request, growing on demand; each request holds the slots of its verified positions until it
finishes."""

from __future__ import annotations

import torch
from radixserve.memory.latent_pool import LatentKVPool
from radixserve.scheduler.speculative.draft_slots import DraftSlotStack


class DraftLatentPool(DraftSlotStack):
    """Slots 1..capacity of a one-layer LatentKVPool (slot 0 stays the pool's padding slot)."""

    def __init__(self, kv_lora_rank: int, rope_dim: int, dtype: torch.dtype, device: torch.device,
                 capacity: int = 1024) -> None:
        self.kv_lora_rank, self.rope_dim = kv_lora_rank, rope_dim
        self.dtype = dtype
        self.pool = LatentKVPool(capacity, 1, kv_lora_rank, rope_dim, dtype, torch.device(device))
        super().__init__(capacity, 1, device)

    @property
    def capacity(self) -> int:
        return self.pool.num_slots

    @property
    def rows(self) -> torch.Tensor:
        """`[capacity + 1, kv_lora_rank + rope_dim]`: row s is slot s's c_kv then k_pe."""
        return self.pool.get_latent(0)

    def write(self, slots: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor) -> None:
        self.pool.set_latent(0, slots, c_kv, k_pe)

    def _grow_storage(self, old: int) -> None:
        bigger = LatentKVPool(2 * old, 1, self.kv_lora_rank, self.rope_dim, self.dtype, self.device)
        bigger.get_latent(0)[: old + 1] = self.rows
        self.pool = bigger
