"""RadixAttention: the model-side attention layer; the math lives in the selected backend."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from radixserve.layers.rotary import is_stock_rotary
from radixserve.state import ForwardMode

if TYPE_CHECKING:
    from radixserve.state import ForwardBatch


class RadixAttention(nn.Module):
    """Holds the per-layer facts a backend needs (see AttentionLayerSpec) and delegates.

    q: [num_tokens, num_heads*head_dim]; k, v: [num_tokens, num_kv_heads*head_dim] (new tokens only).
    Returns [num_tokens, num_heads*head_dim].

    :param sliding_window: None (or 0) for full causal attention; W >= 1: each query sees only its
        W most recent positions, itself included (HF's `sliding_window` convention).
    :param logit_cap: None (or 0) for none; c > 0: scores become c * tanh(score / c) (Gemma 2).

    `sliding_window` and `logit_cap` added in plugin API 1.3."""

    def __init__(self, layer_id: int, num_heads: int, num_kv_heads: int, head_dim: int, scaling: float,
                 sliding_window: int | None = None, logit_cap: float | None = None) -> None:
        super().__init__()
        if sliding_window is not None and (int(sliding_window) != sliding_window or sliding_window < 0):
            raise ValueError(f"layer {layer_id}: sliding_window must be None or an integer >= 1, got {sliding_window!r}")
        if logit_cap is not None and not logit_cap >= 0:
            raise ValueError(f"layer {layer_id}: logit_cap must be None or > 0, got {logit_cap!r}")
        self.layer_id = layer_id
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scaling = scaling
        self.sliding_window = int(sliding_window) if sliding_window else None
        self.logit_cap = float(logit_cap) if logit_cap else None

    def extra_repr(self) -> str:
        return f"layer_id={self.layer_id}, sliding_window={self.sliding_window}, logit_cap={self.logit_cap}"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        return batch.attn_backend.forward(q, k, v, self, batch)

    def forward_rotary(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       rotary: nn.Module, batch: ForwardBatch, qk_norm: QKNorm | None = None) -> torch.Tensor:
        """`forward(*rotary(positions, *qk_norm(q, k)), v, batch)`, letting a backend that declares
        `fuses_rotary_with_kv_store` rotate q and k in its KV-store kernel (decode batches, stock
        `RotaryEmbedding` only; anything else takes the unfused path), and one that also declares
        `fuses_qk_norm_with_rotary` apply a fusable `qk_norm` there too. Added in plugin API 1.5;
        `qk_norm` in 1.6."""
        backend = batch.attn_backend
        if (getattr(backend, "fuses_rotary_with_kv_store", False) and batch.mode is ForwardMode.DECODE
                and is_stock_rotary(rotary)):
            if qk_norm is not None and getattr(backend, "fuses_qk_norm_with_rotary", False) and qk_norm.fusable:
                return backend.forward_decode_rotary(q, k, v, positions, rotary, self, batch, qk_norm=qk_norm)
            if qk_norm is not None:
                q, k = qk_norm(q, k)
            return backend.forward_decode_rotary(q, k, v, positions, rotary, self, batch)
        if qk_norm is not None:
            q, k = qk_norm(q, k)
        q, k = rotary(positions, q, k)
        return self.forward(q, k, v, batch)


def check_kv_layout(model: nn.Module, num_layers: int, num_kv_heads: int, head_dim: int, who: str) -> None:
    """Raise ValueError when a RadixAttention layer of `model` disagrees with the KV pool the runner
    sized (`num_layers` buffer pairs of `num_kv_heads` x `head_dim`): a config whose fields the
    architecture does not use (`num_key_value_heads` on a multi-head model) would otherwise fail
    inside the first KV write as a bare shape error. `who` names the model in the message."""
    for name, layer in model.named_modules():
        if not isinstance(layer, RadixAttention):
            continue
        wrong = [f"{field} {got} (the pool has {want})" for field, got, want in (
            ("num_kv_heads", layer.num_kv_heads, num_kv_heads), ("head_dim", layer.head_dim, head_dim))
            if got != want]
        if not 0 <= layer.layer_id < num_layers:
            wrong.append(f"layer_id {layer.layer_id} (the pool has layers 0..{num_layers - 1})")
        if wrong:
            raise ValueError(
                f"{who}: attention layer {name or '<model>'} has {', '.join(wrong)}; the KV pool is sized from "
                "the model's attention_dims(), else from the config's num_hidden_layers, num_key_value_heads "
                "(or num_attention_heads), head_dim (or hidden_size // num_attention_heads): override "
                "attention_dims() when the architecture reads them otherwise")


class QKNorm:
    """The per-head norms of q and k applied before rotary (Qwen3, Gemma 3): `(q, k) -> (q_norm over
    each head of q, k_norm over each head of k)`, q [n, heads * head_dim] and k [n, kv_heads *
    head_dim] (strided slices of a fused qkv output are fine). What `RadixAttention.forward_rotary`
    hands a backend declaring `fuses_qk_norm_with_rotary`, which applies it in its rotary + KV-store
    kernel only when `fusable`.

    :param q_norm: / `k_norm`: modules normalising the last dim (head_dim values).
    :param head_dim: the head size.

    `fusable`: both are the core `RMSNorm` (its `forward`, not a subclass's) with the same eps and
    weights of one dtype; then `q_weight`, `k_weight` ([head_dim]) and `eps` describe them
    (RMSNorm's recipe: fp32 statistics, the normalised value rounded to the input dtype, times the
    weight, rounded to the output dtype). Added in plugin API 1.6."""

    def __init__(self, q_norm: nn.Module, k_norm: nn.Module, head_dim: int) -> None:
        from radixserve.layers.norm import RMSNorm

        self.q_norm, self.k_norm, self.head_dim = q_norm, k_norm, head_dim
        stock = all(isinstance(m, RMSNorm) and type(m).forward is RMSNorm.forward for m in (q_norm, k_norm))
        self.fusable = stock and q_norm.eps == k_norm.eps and q_norm.weight.dtype == k_norm.weight.dtype

    @property
    def q_weight(self) -> torch.Tensor:
        return self.q_norm.weight

    @property
    def k_weight(self) -> torch.Tensor:
        return self.k_norm.weight

    @property
    def eps(self) -> float:
        return float(self.q_norm.eps)

    def __call__(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n = q.shape[0]
        q = self.q_norm(q.reshape(n, -1, self.head_dim)).reshape(n, -1)
        k = self.k_norm(k.reshape(n, -1, self.head_dim)).reshape(n, -1)
        return q, k


def check_backend_supports_layers(model: nn.Module, backend, backend_name: str) -> None:
    """Raise ValueError when `model` has a RadixAttention layer with an option (sliding window,
    logit soft-capping) that `backend` does not declare support for: it would silently compute
    full, uncapped attention."""
    needs = {"sliding_window": "supports_sliding_window", "logit_cap": "supports_logit_cap"}
    for module in model.modules():
        if not isinstance(module, RadixAttention):
            continue
        for option, flag in needs.items():
            value = getattr(module, option)
            if value is not None and not getattr(backend, flag, False):
                raise ValueError(
                    f"the model's attention layer {module.layer_id} uses {option}={value}, which attention backend "
                    f"{backend_name!r} does not support ({flag} is False); choose a backend that does "
                    f"(torch_native, cpu_batched, triton)")
