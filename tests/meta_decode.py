"""A decode step run entirely on the meta device (test_transformers_fallback,
test_transformers_fallback_fused): any `.item()`, `.tolist()` or branch on a tensor's value in the
model's forward raises there, so a forward that passes has no host synchronisation and can be
captured in a CUDA graph."""

from __future__ import annotations

import torch
from radixserve.state import ForwardBatch, ForwardMode


class ShapeOnlyBackend:
    """Stands in for an attention backend on the meta device: checks the packed layout only."""

    def __init__(self, heads: int, kv_heads: int, head_dim: int) -> None:
        self.dims = (heads, kv_heads, head_dim)

    def forward(self, q, k, v, layer, batch):
        heads, kv_heads, d = self.dims
        assert q.shape == (batch.input_ids.shape[0], heads * d) and k.shape[1] == v.shape[1] == kv_heads * d
        return torch.empty_like(q)


def meta_decode_logits(model, heads: int, kv_heads: int, head_dim: int) -> torch.Tensor:
    """Run one decode step of three requests (lengths 4, 5, 6) through `model` (already on the meta
    device) and return its logits, shape (3, vocab)."""
    meta = lambda n: torch.empty(n, dtype=torch.int64, device="meta")  # noqa: E731
    batch = ForwardBatch(mode=ForwardMode.DECODE, batch_size=3, input_ids=meta(3), positions=meta(3),
                         req_pool_indices=meta(3), seq_lens=meta(3), prefix_lens=meta(3), extend_lens=meta(3),
                         out_cache_loc=meta(3), req_to_token_pool=None, kv_pool=None,
                         attn_backend=ShapeOnlyBackend(heads, kv_heads, head_dim), seq_lens_cpu=[4, 5, 6],
                         prefix_lens_cpu=[3, 4, 5], extend_lens_cpu=[1, 1, 1])
    with torch.inference_mode():
        return model.compute_logits(model(batch.input_ids, batch.positions, batch))
