"""torch_native: attention over the token-slot KV pool with plain torch ops.

The reference backend: a per-request loop around scaled_dot_product_attention with an explicit
causal-offset mask. Slow but exact and easy to audit; GPU kernels are tested against it."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from radixserve.interfaces.attention import AttentionBackend, AttentionLayerSpec
from radixserve.state import ForwardBatch


@dataclass
class _ReqView:
    """What every layer needs about one request of the batch."""

    q_start: int  # first packed row of its new tokens
    q_len: int  # new tokens
    kv_slots: torch.Tensor  # [seq_len] int64 slots, prefix first
    mask: torch.Tensor | None  # [q_len, seq_len] bool (True = attend); None when q_len == 1


class TorchNativeBackend(AttentionBackend):
    supports_tensor_parallel = True  # reads per-rank head counts only
    name = "torch_native"
    supports_tree_mask = True  # verify of tree drafts: new tokens attend by batch.tree_mask
    decode_rows_share_requests = True  # _attend stores all k, v before any row reads the pool

    def __init_subclass__(cls, **kwargs) -> None:
        # a subclass replaces the kernels these promises are about: it must make them itself
        super().__init_subclass__(**kwargs)
        for flag in ("supports_tree_mask", "decode_rows_share_requests"):
            if flag not in cls.__dict__:
                setattr(cls, flag, False)

    def __init__(self, runner_info=None) -> None:
        self.runner_info = runner_info

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        table = batch.req_to_token_pool.req_to_token
        rows = batch.req_pool_indices.tolist()
        views: list[_ReqView] = []
        q_start = 0
        tree = batch.tree_mask_cpu
        for i, (row, seq_len, prefix_len, ext) in enumerate(zip(
            rows, batch.seq_lens_cpu, batch.prefix_lens_cpu, batch.extend_lens_cpu, strict=True
        )):
            slots = table[row, :seq_len]
            mask = None
            if tree is not None and ext > 1:
                # the whole prefix, then among the new tokens only those the draft tree allows
                block = torch.tensor(tree[i], dtype=torch.bool, device=table.device)
                prefix = torch.ones(ext, prefix_len, dtype=torch.bool, device=table.device)
                mask = torch.cat([prefix, block], dim=1)
            elif ext > 1:
                # new token j sits at absolute position prefix_len + j and sees keys 0..prefix_len + j
                q_pos = torch.arange(prefix_len, prefix_len + ext, device=table.device)
                k_pos = torch.arange(seq_len, device=table.device)
                mask = k_pos[None, :] <= q_pos[:, None]
            views.append(_ReqView(q_start, ext, slots, mask))
            q_start += ext
        batch.attn_metadata = views

    def _attend(self, q, k, v, layer: AttentionLayerSpec, batch: ForwardBatch) -> torch.Tensor:
        batch.kv_pool.set_kv(layer.layer_id, batch.out_cache_loc, k, v)
        k_buf, v_buf = batch.kv_pool.get_kv(layer.layer_id)
        n, hq, hkv, d = q.shape[0], layer.num_heads, layer.num_kv_heads, layer.head_dim
        q = q.view(n, hq, d)
        out = torch.empty_like(q)
        for view in batch.attn_metadata:
            qi = q[view.q_start : view.q_start + view.q_len].transpose(0, 1)  # [hq, q_len, d]
            ki = k_buf[view.kv_slots].transpose(0, 1).to(q.dtype)  # [hkv, seq_len, d]
            vi = v_buf[view.kv_slots].transpose(0, 1).to(q.dtype)
            if hkv != hq:
                ki = ki.repeat_interleave(hq // hkv, dim=0)
                vi = vi.repeat_interleave(hq // hkv, dim=0)
            oi = F.scaled_dot_product_attention(
                qi.unsqueeze(0), ki.unsqueeze(0), vi.unsqueeze(0), attn_mask=view.mask, scale=layer.scaling
            )
            out[view.q_start : view.q_start + view.q_len] = oi[0].transpose(0, 1)
        return out.reshape(n, hq * d)

    def forward_extend(self, q, k, v, layer: AttentionLayerSpec, batch: ForwardBatch) -> torch.Tensor:
        return self._attend(q, k, v, layer, batch)

    def forward_decode(self, q, k, v, layer: AttentionLayerSpec, batch: ForwardBatch) -> torch.Tensor:
        return self._attend(q, k, v, layer, batch)
