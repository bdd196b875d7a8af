"""Latent attention (MLA, DeepSeek-V2/V3 style): the shapes and the per-layer facts a backend reads.

What differs from standard attention (see docs/mla.md for the whole picture):

- The KV pool is a `radixserve.memory.LatentKVPool`: per layer and token slot ONE row of
  `kv_lora_rank + qk_rope_head_dim` values, the compressed latent `c_kv` (after the model's
  `kv_a_layernorm`) followed by the shared rotary key part `k_pe` (rotary already applied). There
  are no per-head keys or values in memory; slots, the ReqToTokenPool, the radix cache,
  retraction and chunked prefill are the same as for standard attention.
- Per head h, the key is `[c_kv @ W_UK[h].T, k_pe]` and the value `c_kv @ W_UV[h].T`, where
  W_UK / W_UV are the two halves of the layer's `kv_b_proj` weight. A backend may decompress
  (compute those keys and values) or absorb: `q_lat[h] = q_nope[h] @ W_UK[h]`, scores
  `q_lat[h] . c_kv + q_pe[h] . k_pe`, latent output `o_lat[h] = softmax . c_kv`, and the head's
  output `o_lat[h] @ W_UV[h].T`. Both give the same result; absorbing reads ~1/H of the bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class LatentAttentionDims:
    """The shape of a latent-attention model's attention on this rank.

    A model with `attention_type = "latent"` returns it from `Model.latent_attention_dims()`; the
    runner sizes the `LatentKVPool` from it and hands it to the backend as
    `AttentionRunnerInfo.latent`.

    Added in plugin API 1.4.
    """

    num_layers: int  # layers with latent attention: valid layer_ids are 0..num_layers-1
    num_heads: int  # query heads (this rank)
    kv_lora_rank: int  # width of the compressed latent c_kv
    qk_nope_head_dim: int  # per-head query/key part without rotary
    qk_rope_head_dim: int  # per-head query part with rotary; the key's rotary part is shared by all heads
    v_head_dim: int  # per-head value width (the layer's output is num_heads * v_head_dim)

    @property
    def latent_width(self) -> int:
        """Values one pool row holds per layer and token: kv_lora_rank + qk_rope_head_dim."""
        return self.kv_lora_rank + self.qk_rope_head_dim


class LatentAttentionLayerSpec(Protocol):
    """What a backend may read from the latent-attention layer that calls it
    (`radixserve.layers.latent_attention.RadixLatentAttention` implements it).

    Added in plugin API 1.4."""

    layer_id: int  # index into the LatentKVPool's per-layer buffers
    num_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    scaling: float  # softmax scale (DeepSeek: (nope + rope) ** -0.5, times the YaRN mscale squared)

    @property
    def w_uk(self) -> torch.Tensor:
        """`[num_heads, qk_nope_head_dim, kv_lora_rank]` in the model dtype: head h's key is
        `c_kv @ w_uk[h].T`, so `q_nope[h] @ w_uk[h]` is its query in latent space. A view of the
        layer's weight: read it, never write it."""
        ...

    @property
    def w_uv(self) -> torch.Tensor:
        """`[num_heads, v_head_dim, kv_lora_rank]`: head h's value is `c_kv @ w_uv[h].T`, so its
        output is `o_lat[h] @ w_uv[h].T`. A view: read only."""
        ...
