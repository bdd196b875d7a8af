"""Rotary position embeddings (neox / rotate-half layout, as in HF Llama).

Scaling types: default, linear, llama3, yarn — read from the HF config's `rope_parameters`
(transformers >= 5 keeps `rope_theta` inside it) or the older `rope_scaling` + `rope_theta`."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn as nn

from radixserve.layers import cpu_ops, triton_ops


def rope_parameters_of(config: Any) -> dict[str, Any]:
    """The config's rope parameters as one dict holding at least `rope_type` and `rope_theta`."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    legacy = getattr(config, "rope_scaling", None)
    if not params and legacy:
        params = dict(legacy)
    if "rope_theta" not in params:
        params["rope_theta"] = getattr(config, "rope_theta", None) or 10000.0
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    return params


def _base_inv_freq(base: float, dim: int) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _llama3_inv_freq(inv_freq: torch.Tensor, p: dict[str, Any]) -> torch.Tensor:
    factor = p["factor"]
    low, high = p.get("low_freq_factor", 1.0), p.get("high_freq_factor", 4.0)
    old_ctx = p["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    # long wavelengths are interpolated by `factor`, short ones kept, the band between blended
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, blended, scaled)


def _yarn_inv_freq(base: float, dim: int, p: dict[str, Any], max_position: int) -> tuple[torch.Tensor, float]:
    orig = p.get("original_max_position_embeddings") or max_position
    factor = p.get("factor") or max_position / orig

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn_factor = p.get("attention_factor")
    if attn_factor is None:
        m, m_all = p.get("mscale"), p.get("mscale_all_dim")
        attn_factor = mscale(factor, m) / mscale(factor, m_all) if (m and m_all) else mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    lo, hi = correction_dim(p.get("beta_fast") or 32), correction_dim(p.get("beta_slow") or 1)
    if p.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    if lo == hi:
        hi += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - lo) / (hi - lo), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1.0 - ramp  # 1: keep the original frequency, 0: interpolate
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attn_factor)


def compute_inv_freq(rotary_dim: int, params: dict[str, Any], max_position: int) -> tuple[torch.Tensor, float]:
    """(inv_freq [rotary_dim/2] fp32, attention scaling of cos/sin)."""
    base, rope_type = float(params["rope_theta"]), params["rope_type"]
    if rope_type == "default":
        return _base_inv_freq(base, rotary_dim), 1.0
    if rope_type == "linear":
        return _base_inv_freq(base, rotary_dim) / params["factor"], 1.0
    if rope_type == "llama3":
        return _llama3_inv_freq(_base_inv_freq(base, rotary_dim), params), 1.0
    if rope_type == "yarn":
        return _yarn_inv_freq(base, rotary_dim, params, max_position)
    raise NotImplementedError(f"rope_type {rope_type!r} is not supported (default, linear, llama3, yarn)")


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryEmbedding(nn.Module):
    """`forward(positions, q, k)` rotates the first `rotary_dim` dims of every head of q and k.

    q: [n, num_heads*head_dim], k: [n, num_kv_heads*head_dim]; returns tensors of the same shapes.
    cos/sin are cached for positions < max_position in fp32 and cast to q's dtype, as HF does.
    For CUDA tensors one Triton kernel rotates q and k (`triton_ops.rotary`, same roundings); fp32
    CPU matrices are rotated by one C++ kernel (`cpu_ops.rotary`)."""

    def __init__(self, head_dim: int, rotary_dim: int, max_position: int, params: dict[str, Any]) -> None:
        super().__init__()
        self.head_dim, self.rotary_dim, self.max_position = head_dim, rotary_dim, max_position
        inv_freq, self.attention_scaling = compute_inv_freq(rotary_dim, params, max_position)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self._cache: tuple[torch.Tensor, torch.Tensor] | None = None
        # True once `reserve` sized the cache for every position the runtime can ask for: then the
        # forward never reads positions back to the host (a sync that CUDA-graph capture forbids)
        self._covers_context = False

    def _build(self, n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        t = torch.arange(n, dtype=torch.float32, device=device)
        freqs = t[:, None] * self.inv_freq.to(device, torch.float32)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling

    def reserve(self, n: int, device: torch.device, shared: dict | None = None) -> None:
        """Precompute cos/sin for positions < n (the runtime's context length). `shared` lets layers
        with identical rotary parameters use one cache instead of one per layer."""
        key = (n, str(device), self.rotary_dim, self.attention_scaling, tuple(self.inv_freq.tolist()))
        if shared is not None and key in shared:
            self._cache = shared[key]
        else:
            self._cache = self._build(n, torch.device(device))
            if shared is not None:
                shared[key] = self._cache
        self._covers_context = True

    def _cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self._tables(positions)
        return cos[positions], sin[positions]

    def cos_sin_tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The fp32 cos and sin caches `[>= max(positions) + 1, rotary_dim]` (attention scaling
        applied) that `forward` gathers row `positions[i]` of; what a fused kernel reads. Reads
        nothing back to the host once `reserve` sized them for the context. Added in plugin API 1.5."""
        return self._tables(positions)

    def _tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The fp32 cos/sin caches, covering every position in `positions`."""
        if not (self._covers_context and self._cache is not None and self._cache[0].device == positions.device):
            need = int(positions.max()) + 1 if positions.numel() else 1
            if self._cache is None or self._cache[0].shape[0] < need or self._cache[0].device != positions.device:
                self._cache = self._build(max(need, min(self.max_position, 8192)), positions.device)
        return self._cache

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        x = x.view(n, -1, self.head_dim)
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        rot = rot * cos[:, None, :] + _rotate_half(rot) * sin[:, None, :]
        out = torch.cat((rot, rest), dim=-1) if rest.shape[-1] else rot
        return out.reshape(n, -1)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if triton_ops.available(q) and k.dtype == q.dtype:  # the kernel gathers and casts cos/sin itself
            cos, sin = self._tables(positions)
            return triton_ops.rotary(q, k, cos, sin, self.head_dim, self.rotary_dim, positions=positions)
        if cpu_ops.available(q, k) and positions.dtype == torch.int64:
            cos, sin = self._tables(positions)
            if cos.device.type == "cpu" and cos.dtype == torch.float32:
                return cpu_ops.rotary(q, k, positions.contiguous(), cos, sin, self.head_dim, self.rotary_dim)
        cos, sin = self._cos_sin(positions)
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)


def is_stock_rotary(rotary: Any) -> bool:
    """True for a `RotaryEmbedding` whose `forward` is the stock one (a subclass may change the
    tables, not the rotation): what `AttentionBackend.forward_decode_rotary` may fuse.
    Added in plugin API 1.5."""
    return isinstance(rotary, RotaryEmbedding) and type(rotary).forward is RotaryEmbedding.forward


def get_rope(config: Any, head_dim: int, max_position: int | None = None) -> RotaryEmbedding:
    """Build the rotary embedding an HF config asks for."""
    params = rope_parameters_of(config)
    partial = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)) or 1.0
    max_pos = max_position or getattr(config, "max_position_embeddings", 4096)
    return RotaryEmbedding(head_dim, int(head_dim * partial), max_pos, params)


def reserve_rotary_caches(model: nn.Module, context_len: int, device: torch.device) -> None:
    """Size every rotary cache of `model` for `context_len` positions, sharing identical ones."""
    shared: dict = {}
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.reserve(context_len, device, shared)
