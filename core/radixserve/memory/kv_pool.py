"""KVPool: per-layer K and V buffers indexed by token slot."""

from __future__ import annotations

import torch

from radixserve.memory.fp8_kv import FP8_KV_DTYPE, dequantize_fp8, quantize_fp8
from radixserve.memory.host_zeros import zeros_on_demand


class KVPool:
    """K and V buffers of shape `[num_slots + 1, num_kv_heads, head_dim]` per layer.

    Slot 0 is reserved as a padding/dummy slot (padded batches may write there); real slots are
    1..num_slots, matching `TokenAllocator(num_slots)`.

    FP8 pools (plugin API 1.5): with `dtype=torch.float8_e4m3fn` the buffers hold k / k_scale and
    v / v_scale saturated to e4m3 (`radixserve.memory.fp8_kv`), with one k and one v scale per layer
    (`k_scales`, `v_scales`: floats, default 1.0). `set_kv` quantizes; a reader dequantizes with
    `kv_scales(layer_id)` (or `read_kv`)."""

    def __init__(
        self,
        num_slots: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: str | torch.device = "cpu",
        *,
        k_scales: list[float] | None = None,
        v_scales: list[float] | None = None,
    ) -> None:
        self.num_slots = num_slots
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self.k_scales = _layer_scales(k_scales, num_layers, "k_scales")
        self.v_scales = _layer_scales(v_scales, num_layers, "v_scales")
        if dtype != FP8_KV_DTYPE and (set(self.k_scales) | set(self.v_scales)) != {1.0}:
            raise ValueError(f"KV scales apply to float8_e4m3fn pools only; this pool is {dtype}")
        shape = (num_slots + 1, num_kv_heads, head_dim)
        # on the CPU, pages become resident as slots are written (the pool is sized for the worst case)
        self.k_buffers = [zeros_on_demand(shape, dtype, self.device) for _ in range(num_layers)]
        self.v_buffers = [zeros_on_demand(shape, dtype, self.device) for _ in range(num_layers)]

    def set_kv(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write k, v ([n, num_kv_heads, head_dim] or [n, num_kv_heads*head_dim]) into slots `loc`."""
        shape = (-1, self.num_kv_heads, self.head_dim)
        k, v = self.quantize_kv(layer_id, k.reshape(shape), v.reshape(shape))
        self.k_buffers[layer_id][loc] = k
        self.v_buffers[layer_id][loc] = v

    def get_kv(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_buffers[layer_id], self.v_buffers[layer_id]

    @property
    def is_fp8(self) -> bool:
        """The buffers are float8_e4m3fn: read them through `kv_scales` (plugin API 1.5)."""
        return self.dtype == FP8_KV_DTYPE

    def kv_scales(self, layer_id: int) -> tuple[float, float]:
        """(k scale, v scale) of the layer: a stored value times its scale is the real value
        (always (1.0, 1.0) for a pool in a float dtype). Added in plugin API 1.5."""
        return self.k_scales[layer_id], self.v_scales[layer_id]

    def quantize_kv(self, layer_id: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v as `set_kv` stores them (the pool dtype; fp8: divided by the layer's scales and
        saturated). Tensors already in float8_e4m3fn are taken as quantized. Added in plugin API 1.5."""
        if not self.is_fp8:
            return k.to(self.dtype), v.to(self.dtype)
        k_scale, v_scale = self.kv_scales(layer_id)
        if k.dtype != FP8_KV_DTYPE:
            k = quantize_fp8(k, k_scale)
        if v.dtype != FP8_KV_DTYPE:
            v = quantize_fp8(v, v_scale)
        return k, v

    def read_kv(self, layer_id: int, loc: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The real k, v values at slots `loc` (`[n, num_kv_heads, head_dim]` each) in `dtype`,
        dequantized for an fp8 pool (`stored.float() * scale`). Added in plugin API 1.5."""
        k, v = self.k_buffers[layer_id][loc], self.v_buffers[layer_id][loc]
        if not self.is_fp8:
            return k.to(dtype), v.to(dtype)
        k_scale, v_scale = self.kv_scales(layer_id)
        return dequantize_fp8(k, k_scale, dtype), dequantize_fp8(v, v_scale, dtype)

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


def _layer_scales(scales: list[float] | None, num_layers: int, name: str) -> list[float]:
    if scales is None:
        return [1.0] * num_layers
    out = [float(x) for x in scales]
    if len(out) != num_layers or not all(0 < x < float("inf") for x in out):
        raise ValueError(f"{name} must be {num_layers} positive finite floats (one per layer), got {scales!r}")
    return out
