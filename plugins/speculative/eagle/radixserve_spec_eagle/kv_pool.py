"""The draft model's own KV memory: one pool of token slots shared by every request, growing on
demand, each request holding the slots of its verified positions until it is released."""

from __future__ import annotations

import torch


class DraftKVPool:
    """`k[layer][slot]`, `v[layer][slot]`: [num_kv_heads, head_dim] per slot."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, capacity: int = 1024) -> None:
        self.shape = (num_kv_heads, head_dim)
        self.dtype, self.device = dtype, device
        self.k = [torch.zeros(capacity, *self.shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(capacity, *self.shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self._free = list(range(capacity - 1, -1, -1))  # a stack: low slots first

    @property
    def capacity(self) -> int:
        return self.k[0].shape[0]

    def free_slots(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> torch.Tensor:
        """`n` slots (int64, on the pool's device); the pool doubles when it runs out."""
        while len(self._free) < n:
            self._grow()
        got = [self._free.pop() for _ in range(n)]
        return torch.tensor(got, dtype=torch.int64, device=self.device)

    def free(self, slots: torch.Tensor) -> None:
        self._free.extend(reversed(slots.tolist()))

    def _grow(self) -> None:
        old = self.capacity
        for arrays in (self.k, self.v):
            for i, a in enumerate(arrays):
                arrays[i] = torch.cat([a, torch.zeros_like(a)])
        self._free[:0] = list(range(2 * old - 1, old - 1, -1))
