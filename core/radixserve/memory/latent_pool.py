"""LatentKVPool: per-layer latent rows (MLA) indexed by token slot."""

from __future__ import annotations

import torch

from radixserve.memory.host_zeros import zeros_on_demand


class LatentKVPool:
    """One buffer per layer of shape `[num_slots + 1, kv_lora_rank + rope_dim]`: row s holds the
    compressed latent `c_kv` of the token in slot s (its first `kv_lora_rank` values) and the
    shared rotary key part `k_pe` (the last `rope_dim`).

    Slot 0 is the reserved padding slot, as in `KVPool`; real slots are 1..num_slots, matching
    `TokenAllocator(num_slots)`. Added in plugin API 1.4."""

    def __init__(
        self,
        num_slots: int,
        num_layers: int,
        kv_lora_rank: int,
        rope_dim: int,
        dtype: torch.dtype,
        device: str | torch.device = "cpu",
    ) -> None:
        self.num_slots = num_slots
        self.num_layers = num_layers
        self.kv_lora_rank = kv_lora_rank
        self.rope_dim = rope_dim
        self.dtype = dtype
        self.device = torch.device(device)
        shape = (num_slots + 1, kv_lora_rank + rope_dim)
        self.latent_buffers = [zeros_on_demand(shape, dtype, self.device) for _ in range(num_layers)]

    def set_latent(self, layer_id: int, loc: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor) -> None:
        """Write c_kv `[n, kv_lora_rank]` and k_pe `[n, rope_dim]` (or `[n, 1, rope_dim]`) into slots `loc`."""
        buf = self.latent_buffers[layer_id]
        buf[loc, : self.kv_lora_rank] = c_kv.reshape(-1, self.kv_lora_rank).to(self.dtype)
        buf[loc, self.kv_lora_rank :] = k_pe.reshape(-1, self.rope_dim).to(self.dtype)

    def get_latent(self, layer_id: int) -> torch.Tensor:
        """The layer's buffer (a view, writable in place): `[:, :kv_lora_rank]` is c_kv, the rest k_pe."""
        return self.latent_buffers[layer_id]

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.latent_buffers)


def latent_bytes_per_token(num_layers: int, kv_lora_rank: int, rope_dim: int, dtype: torch.dtype) -> int:
    """Bytes one token's latent rows take across all layers."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return num_layers * (kv_lora_rank + rope_dim) * itemsize
