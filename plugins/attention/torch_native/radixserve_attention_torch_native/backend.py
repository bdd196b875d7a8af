"""torch_native: attention over the token-slot KV pool with plain torch ops.

The reference backend: a per-request loop around scaled_dot_product_attention with an explicit
causal-offset mask. Slow but exact and easy to audit; GPU kernels are tested against it.
FP8 KV pools (plugin API 1.5) are the reference too: every key and value is read back through
`KVPool.read_kv` (stored.float() * the layer's scale), the new tokens' as well.
Per-layer options (plugin API 1.3): a sliding window narrows the mask (built once per forward and
window size, shared by the layers that use it); a logit cap computes the scores explicitly (SDPA
has no soft-capping) and caps them before the mask.
Latent attention (MLA, plugin API 1.4) is the exact decompressed form: per request the latent rows
of its slots become per-head keys [c_kv @ w_uk[h].T, k_pe] and values c_kv @ w_uv[h].T, then the
same masked attention as the standard path (see radixserve.interfaces.latent_attention)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from radixserve.interfaces.attention import AttentionBackend, AttentionLayerSpec
from radixserve.interfaces.latent_attention import LatentAttentionLayerSpec
from radixserve.state import ForwardBatch


@dataclass
class _ReqView:
    """What every layer needs about one request of the batch."""

    q_start: int  # first packed row of its new tokens
    q_len: int  # new tokens
    kv_slots: torch.Tensor  # [seq_len] int64 slots, prefix first
    mask: torch.Tensor | None  # [q_len, seq_len] bool (True = attend); None when q_len == 1
    q_pos: torch.Tensor  # [q_len, 1] int64 absolute positions of the new tokens
    k_pos: torch.Tensor  # [1, seq_len] int64 absolute positions of the keys
    windowed: dict[int, torch.Tensor | None] = field(default_factory=dict)  # window -> mask (None: all)
    plain_causal: bool = False  # `mask` is the causal mask (no draft tree)

    def mask_for(self, window: int | None) -> torch.Tensor | None:
        """The attention mask of a layer with this sliding window (None: full causal)."""
        if not window:
            return self.mask
        if window not in self.windowed:
            inside = self.k_pos > self.q_pos - window
            mask = inside if self.mask is None else self.mask & inside
            self.windowed[window] = None if bool(mask.all()) else mask
        return self.windowed[window]


class TorchNativeBackend(AttentionBackend):
    supports_tensor_parallel = True  # reads per-rank head counts only
    name = "torch_native"
    supports_tree_mask = True  # verify of tree drafts: new tokens attend by batch.tree_mask
    decode_rows_share_requests = True  # _attend stores all k, v before any row reads the pool
    supports_sliding_window = True  # per-layer windows and soft-capping (plugin API 1.3)
    supports_logit_cap = True
    supports_latent_attention = True  # MLA, decompressed (plugin API 1.4)
    supports_fp8_kv_cache = True  # fp8 pools: quantized by set_kv, dequantized on read (plugin API 1.5)
    supports_bf16_kv_cache = True  # bf16 pools of fp32 models: rounded by set_kv, widened by read_kv (1.8)

    def __init_subclass__(cls, **kwargs) -> None:
        # a subclass replaces the kernels these promises are about: it must make them itself
        super().__init_subclass__(**kwargs)
        for flag in ("supports_tree_mask", "decode_rows_share_requests", "supports_sliding_window",
                     "supports_logit_cap", "supports_latent_attention", "supports_fp8_kv_cache",
                     "supports_bf16_kv_cache"):
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
            # new token j sits at absolute position prefix_len + j (a draft at prefix_len + its depth)
            q_pos = torch.arange(prefix_len, prefix_len + ext, device=table.device)
            k_pos = torch.arange(seq_len, device=table.device)
            if tree is not None and ext > 1:
                # the whole prefix, then among the new tokens only those the draft tree allows
                block = torch.tensor(tree[i], dtype=torch.bool, device=table.device)
                prefix = torch.ones(ext, prefix_len, dtype=torch.bool, device=table.device)
                mask = torch.cat([prefix, block], dim=1)
                q_pos = prefix_len + block.sum(1, dtype=torch.int64) - 1  # ancestors and itself
                k_pos = torch.cat([k_pos[:prefix_len], q_pos])
            elif ext > 1:
                mask = k_pos[None, :] <= q_pos[:, None]  # causal
            views.append(_ReqView(q_start, ext, slots, mask, q_pos[:, None], k_pos[None, :],
                                  plain_causal=mask is not None and tree is None))
            q_start += ext
        batch.attn_metadata = views

    def _attend(self, q, k, v, layer: AttentionLayerSpec, batch: ForwardBatch) -> torch.Tensor:
        pool = batch.kv_pool
        pool.set_kv(layer.layer_id, batch.out_cache_loc, k, v)
        n, hq, hkv, d = q.shape[0], layer.num_heads, layer.num_kv_heads, layer.head_dim

        def keys_values(view: _ReqView) -> tuple[torch.Tensor, torch.Tensor]:
            # every key and value as stored (an fp8 pool: dequantized, the new tokens' included)
            ki, vi = pool.read_kv(layer.layer_id, view.kv_slots, q.dtype)
            ki, vi = ki.transpose(0, 1), vi.transpose(0, 1)  # [hkv, seq_len, d]
            if hkv != hq:
                ki = ki.repeat_interleave(hq // hkv, dim=0)
                vi = vi.repeat_interleave(hq // hkv, dim=0)
            return ki, vi

        return self._attend_views(q.view(n, hq, d), keys_values, d, layer, batch)

    def _attend_views(self, q: torch.Tensor, keys_values, v_dim: int, layer, batch: ForwardBatch) -> torch.Tensor:
        """q `[n, h, dk]`; `keys_values(view)` gives the request's `[h, seq_len, dk]` keys and
        `[h, seq_len, v_dim]` values. Masked attention per request -> `[n, h * v_dim]`."""
        n, h = q.shape[0], q.shape[1]
        out = q.new_empty(n, h, v_dim)
        window, cap = getattr(layer, "sliding_window", None), getattr(layer, "logit_cap", None)
        for view in batch.attn_metadata:
            qi = q[view.q_start : view.q_start + view.q_len].transpose(0, 1)  # [h, q_len, dk]
            ki, vi = keys_values(view)
            mask = view.mask_for(window)
            if cap:
                oi = capped_attention(qi, ki, vi, mask, layer.scaling, cap)
            elif mask is not None and mask is view.mask and view.plain_causal and view.q_len == ki.shape[1]:
                # a whole prompt, no prefix: SDPA's own causal mask, which skips the masked blocks
                # (about twice as fast on the CPU as the same mask given as a tensor); the same result
                oi = F.scaled_dot_product_attention(qi.unsqueeze(0), ki.unsqueeze(0), vi.unsqueeze(0), is_causal=True,
                                                    scale=layer.scaling)[0]
            else:
                oi = F.scaled_dot_product_attention(
                    qi.unsqueeze(0), ki.unsqueeze(0), vi.unsqueeze(0), attn_mask=mask, scale=layer.scaling
                )[0]
            out[view.q_start : view.q_start + view.q_len] = oi.transpose(0, 1)
        return out.reshape(n, h * v_dim)

    def _attend_latent(self, q_nope, q_pe, c_kv, k_pe, layer: LatentAttentionLayerSpec,
                       batch: ForwardBatch) -> torch.Tensor:
        # every new row is stored before any request reads: decode rows may share a request
        batch.kv_pool.set_latent(layer.layer_id, batch.out_cache_loc, c_kv, k_pe)
        buf = batch.kv_pool.get_latent(layer.layer_id)
        h, lora = layer.num_heads, layer.kv_lora_rank
        dtype = q_nope.dtype
        w_uk, w_uv = layer.w_uk.to(dtype), layer.w_uv.to(dtype)  # [h, nope, lora], [h, v, lora]
        q = torch.cat([q_nope.reshape(-1, h, layer.qk_nope_head_dim), q_pe.reshape(-1, h, layer.qk_rope_head_dim)],
                      dim=-1)  # [n, h, nope + rope]

        def keys_values(view: _ReqView) -> tuple[torch.Tensor, torch.Tensor]:
            rows = buf[view.kv_slots].to(dtype)  # [seq_len, lora + rope]
            latent, pe = rows[:, :lora], rows[:, lora:]
            k_nope = torch.einsum("sc,hdc->hsd", latent, w_uk)
            keys = torch.cat([k_nope, pe.unsqueeze(0).expand(h, -1, -1)], dim=-1)  # [h, seq_len, nope + rope]
            return keys, torch.einsum("sc,hdc->hsd", latent, w_uv)

        return self._attend_views(q, keys_values, layer.v_head_dim, layer, batch)

    def forward_extend(self, q, k, v, layer: AttentionLayerSpec, batch: ForwardBatch) -> torch.Tensor:
        return self._attend(q, k, v, layer, batch)

    def forward_decode(self, q, k, v, layer: AttentionLayerSpec, batch: ForwardBatch) -> torch.Tensor:
        return self._attend(q, k, v, layer, batch)

    def forward_latent_extend(self, q_nope, q_pe, c_kv, k_pe, layer: LatentAttentionLayerSpec,
                              batch: ForwardBatch) -> torch.Tensor:
        return self._attend_latent(q_nope, q_pe, c_kv, k_pe, layer, batch)

    def forward_latent_decode(self, q_nope, q_pe, c_kv, k_pe, layer: LatentAttentionLayerSpec,
                              batch: ForwardBatch) -> torch.Tensor:
        return self._attend_latent(q_nope, q_pe, c_kv, k_pe, layer, batch)


def capped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
                     cap: float) -> torch.Tensor:
    """Attention with soft-capped scores: q [..., t, d], k/v [..., s, d], mask [t, s] bool (True = attend)
    or None. Scores cap * tanh(scale * q.k / cap), softmax in fp32 (as transformers does)."""
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    scores = cap * torch.tanh(scores / cap)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(scores.softmax(-1).to(v.dtype), v)
