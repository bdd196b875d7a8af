"""RadixLatentAttention: the model-side layer of multi-head latent attention (MLA); the math lives
in the selected backend's `forward_latent_*` (see radixserve.interfaces.latent_attention)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn as nn

if TYPE_CHECKING:
    from radixserve.state import ForwardBatch


class RadixLatentAttention(nn.Module):
    """Holds the per-layer facts a latent backend reads (LatentAttentionLayerSpec) and delegates.

    :param kv_b_proj: the layer's up-projection from the latent, a module whose `weight` is
        `[num_heads * (qk_nope_head_dim + v_head_dim), kv_lora_rank]` (HF's `kv_b_proj`, per head the
        key rows then the value rows; this rank's heads under tensor parallelism). It must stay
        unquantized: `w_uk` / `w_uv` are views of that weight. It is not registered as a child here
        (the attention module that owns it loads it).

    forward(q_nope [T, H, nope], q_pe [T, H, rope], c_kv [T, lora], k_pe [T, rope], batch) returns
    `[T, H * v_head_dim]`; rotary is applied to q_pe and k_pe and the latent norm to c_kv before.

    Added in plugin API 1.4."""

    def __init__(self, layer_id: int, num_heads: int, kv_lora_rank: int, qk_nope_head_dim: int,
                 qk_rope_head_dim: int, v_head_dim: int, scaling: float, kv_b_proj: nn.Module) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = num_heads
        self.kv_lora_rank = kv_lora_rank
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.scaling = scaling
        # a plain attribute list keeps nn.Module from registering kv_b_proj twice
        self._kv_b_proj = [kv_b_proj]

    def _per_head(self) -> torch.Tensor:
        w = self._kv_b_proj[0].weight
        return w.view(self.num_heads, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank)

    @property
    def w_uk(self) -> torch.Tensor:
        return self._per_head()[:, : self.qk_nope_head_dim]

    @property
    def w_uv(self) -> torch.Tensor:
        return self._per_head()[:, self.qk_nope_head_dim :]

    def extra_repr(self) -> str:
        return (f"layer_id={self.layer_id}, heads={self.num_heads}, kv_lora_rank={self.kv_lora_rank}, "
                f"rope={self.qk_rope_head_dim}, v={self.v_head_dim}")

    def forward(self, q_nope: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor,
                batch: ForwardBatch) -> torch.Tensor:
        return batch.attn_backend.forward_latent(q_nope, q_pe, c_kv, k_pe, self, batch)
