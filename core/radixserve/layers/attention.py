"""RadixAttention: the model-side attention layer; the math lives in the selected backend."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn as nn

if TYPE_CHECKING:
    from radixserve.state import ForwardBatch


class RadixAttention(nn.Module):
    """Holds the per-layer facts a backend needs (see AttentionLayerSpec) and delegates.

    q: [num_tokens, num_heads*head_dim]; k, v: [num_tokens, num_kv_heads*head_dim] (new tokens only).
    Returns [num_tokens, num_heads*head_dim]."""

    def __init__(self, layer_id: int, num_heads: int, num_kv_heads: int, head_dim: int, scaling: float) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scaling = scaling

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        return batch.attn_backend.forward(q, k, v, self, batch)
