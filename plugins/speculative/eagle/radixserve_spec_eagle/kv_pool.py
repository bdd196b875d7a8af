"""The draft model's own KV memory: one pool of token slots shared by every request, growing on
demand, each request holding the slots of its verified positions until it is released."""

from __future__ import annotations

import torch
from radixserve.scheduler.speculative.draft_slots import DraftSlotStack


class DraftKVPool(DraftSlotStack):
    """`k[layer][slot]`, `v[layer][slot]`: [num_kv_heads, head_dim] per slot."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, capacity: int = 1024) -> None:
        self.shape = (num_kv_heads, head_dim)
        self.dtype = dtype
        self.k = [torch.zeros(capacity, *self.shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(capacity, *self.shape, dtype=dtype, device=device) for _ in range(num_layers)]
        super().__init__(capacity, 0, device)

    @property
    def capacity(self) -> int:
        return self.k[0].shape[0]

    def _grow_storage(self, old: int) -> None:
        for arrays in (self.k, self.v):
            for i, a in enumerate(arrays):
                arrays[i] = torch.cat([a, torch.zeros_like(a)])
