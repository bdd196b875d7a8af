"""KVPool: per-layer K and V buffers indexed by token slot."""

from __future__ import annotations

import torch


class KVPool:
    """K and V buffers of shape `[num_slots + 1, num_kv_heads, head_dim]` per layer.

    Slot 0 is reserved as a padding/dummy slot (padded batches may write there); real slots are
    1..num_slots, matching `TokenAllocator(num_slots)`."""

    def __init__(
        self,
        num_slots: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: str | torch.device = "cpu",
    ) -> None:
        self.num_slots = num_slots
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        shape = (num_slots + 1, num_kv_heads, head_dim)
        self.k_buffers = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self.v_buffers = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]

    def set_kv(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write k, v ([n, num_kv_heads, head_dim] or [n, num_kv_heads*head_dim]) into slots `loc`."""
        shape = (-1, self.num_kv_heads, self.head_dim)
        self.k_buffers[layer_id][loc] = k.reshape(shape).to(self.dtype)
        self.v_buffers[layer_id][loc] = v.reshape(shape).to(self.dtype)

    def get_kv(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_buffers[layer_id], self.v_buffers[layer_id]

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.k_buffers + self.v_buffers)


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes one token's K and V take across all layers."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * num_kv_heads * head_dim * itemsize


def tokens_for_budget(budget_bytes: float, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """How many token slots fit in `budget_bytes` (at least 1 so a pool can always be built)."""
    per_token = kv_bytes_per_token(num_layers, num_kv_heads, head_dim, dtype)
    return max(1, int(budget_bytes // per_token))
