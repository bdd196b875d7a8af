"""The MTP module as plain torch modules: input fusion, one DeepSeek decoder layer (MLA attention +
MoE or dense MLP) and the shared head.

Attention is delegated to an `attend(q_nope, q_pe, c_kv, k_pe) -> [n, H * v_head_dim]` callable so
the draft's latent KV lives where the drafter keeps it (its own LatentKVPool, see kv_pool.py); the
math over those latents is `latent_attention` below (absorbed form, as in
radixserve.interfaces.latent_attention)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from radixserve.layers.moe.routing import RoutingConfig, select_experts
from radixserve.layers.norm import RMSNorm
from radixserve.layers.rotary import get_rope, rope_parameters_of

from radixserve_spec_mtp.checkpoint import MtpCheckpointError, MtpWeights

Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def softmax_scale(config) -> float:
    """(nope + rope) ** -0.5, times YaRN's mscale squared when the rope is scaled with mscale_all_dim
    (DeepSeek-V3's rule)."""
    import math

    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    params = rope_parameters_of(config)
    factor, m_all = params.get("factor"), params.get("mscale_all_dim")
    if params["rope_type"] != "default" and m_all and factor and factor > 1:
        m = 0.1 * m_all * math.log(factor) + 1.0
        scale *= m * m
    return scale


def latent_attention(q_nope, q_pe, latents, w_uk, w_uv, kv_lora_rank: int, scaling: float, mask) -> torch.Tensor:
    """Multi-head latent attention over cached latent rows, batched.

    q_nope [b, r, H, nope], q_pe [b, r, H, rope], latents [b, T, lora + rope] (c_kv then k_pe),
    w_uk [H, nope, lora], w_uv [H, v, lora], mask [b, r, T] (True: may attend) -> [b, r, H * v]."""
    c_kv, k_pe = latents[..., :kv_lora_rank], latents[..., kv_lora_rank:]
    q_lat = torch.einsum("brhd,hdl->brhl", q_nope, w_uk)
    scores = torch.einsum("brhl,btl->bhrt", q_lat.float(), c_kv.float())
    scores = scores + torch.einsum("brhd,btd->bhrt", q_pe.float(), k_pe.float())
    scores = (scores * scaling).masked_fill(~mask[:, None], float("-inf"))
    probs = scores.softmax(-1)
    o_lat = torch.einsum("bhrt,btl->brhl", probs, c_kv.float()).to(q_nope.dtype)
    out = torch.einsum("brhl,hvl->brhv", o_lat, w_uv)
    return out.reshape(*out.shape[:2], -1)


class MlaAttention(nn.Module):
    """DeepSeek's multi-head latent attention projections; the attention itself is `attend`."""

    def __init__(self, cfg) -> None:
        super().__init__()
        h, nh = cfg.hidden_size, cfg.num_attention_heads
        self.num_heads, self.kv_lora_rank = nh, cfg.kv_lora_rank
        self.nope, self.rope, self.v = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        qk = self.nope + self.rope
        bias = bool(getattr(cfg, "attention_bias", False))
        self.q_lora_rank = getattr(cfg, "q_lora_rank", None)
        if self.q_lora_rank:
            self.q_a_proj = nn.Linear(h, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, 1e-6)
            self.q_b_proj = nn.Linear(self.q_lora_rank, nh * qk, bias=False)
        else:
            self.q_proj = nn.Linear(h, nh * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, self.kv_lora_rank + self.rope, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, 1e-6)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, nh * (self.nope + self.v), bias=False)
        self.o_proj = nn.Linear(nh * self.v, h, bias=bias)
        self.rotary_emb = get_rope(cfg, self.rope)
        self.interleaved = bool(getattr(cfg, "rope_interleave", True))
        self.scaling = softmax_scale(cfg)

    @property
    def w_uk(self) -> torch.Tensor:
        return self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v, self.kv_lora_rank)[:, : self.nope]

    @property
    def w_uv(self) -> torch.Tensor:
        return self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v, self.kv_lora_rank)[:, self.nope :]

    def _deinterleave(self, x: torch.Tensor) -> torch.Tensor:
        """DeepSeek's rotary pairs are (x0, x1), (x2, x3)...: reorder to rotate-half layout (q and k
        alike, so their dot products are unchanged)."""
        if not self.interleaved:
            return x
        return x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, attend: Attend) -> torch.Tensor:
        n = x.shape[0]
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.q_lora_rank else self.q_proj(x)
        q = q.view(n, self.num_heads, self.nope + self.rope)
        q_nope, q_pe = q[..., : self.nope], self._deinterleave(q[..., self.nope :])
        kv = self.kv_a_proj_with_mqa(x)
        c_kv = self.kv_a_layernorm(kv[:, : self.kv_lora_rank].contiguous())
        k_pe = self._deinterleave(kv[:, self.kv_lora_rank :])
        q_pe, k_pe = self.rotary_emb(positions, q_pe.reshape(n, -1).contiguous(), k_pe.contiguous())
        out = attend(q_nope, q_pe.view(n, self.num_heads, self.rope), c_kv, k_pe)
        return self.o_proj(out)


class Mlp(nn.Module):
    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Gate(nn.Module):
    def __init__(self, hidden: int, num_experts: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts)) if bias else None


class Moe(nn.Module):
    """DeepSeek's MoE: routed experts (core routing rules) plus shared experts. Experts run one by
    one over the rows routed to them: a draft layer sees a few rows per step."""

    def __init__(self, cfg, has_bias: bool, has_shared: bool) -> None:
        super().__init__()
        h, e = cfg.hidden_size, cfg.n_routed_experts
        self.gate = Gate(h, e, has_bias)
        self.experts = nn.ModuleList(Mlp(h, cfg.moe_intermediate_size) for _ in range(e))
        shared = cfg.moe_intermediate_size * (getattr(cfg, "n_shared_experts", 0) or 0)
        self.shared_experts = Mlp(h, shared) if has_shared and shared else None
        groups = getattr(cfg, "n_group", None)
        self.routing = RoutingConfig(
            top_k=cfg.num_experts_per_tok, scoring=getattr(cfg, "scoring_func", "sigmoid") or "sigmoid",
            renormalize=bool(getattr(cfg, "norm_topk_prob", True)),
            num_expert_group=groups if groups and groups > 1 else None,
            topk_group=getattr(cfg, "topk_group", None) if groups and groups > 1 else None,
            routed_scaling_factor=float(getattr(cfg, "routed_scaling_factor", 1.0) or 1.0),
        )
        try:
            self.routing.validate(e)
        except ValueError as err:
            raise MtpCheckpointError(f"MTP layer MoE: {err}") from None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x.float(), self.gate.weight.float())
        bias = self.gate.e_score_correction_bias
        weights, ids = select_experts(logits, self.routing, bias)
        out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
        for e in ids.unique().tolist():
            rows, slot = (ids == e).nonzero(as_tuple=True)
            out.index_add_(0, rows, self.experts[e](x[rows]).float() * weights[rows, slot, None])
        out = out.to(x.dtype)
        return out + self.shared_experts(x) if self.shared_experts is not None else out


class DecoderLayer(nn.Module):
    """One DeepSeek-V2/V3 decoder layer (pre-norm, residual stream in and out)."""

    def __init__(self, cfg, mlp: nn.Module) -> None:
        super().__init__()
        eps = cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.self_attn = MlaAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.mlp = mlp

    def forward(self, positions: torch.Tensor, x: torch.Tensor, attend: Attend) -> torch.Tensor:
        x = x + self.self_attn(positions, self.input_layernorm(x), attend)
        return x + self.mlp(self.post_attention_layernorm(x))


class SharedHead(nn.Module):
    def __init__(self, cfg, own_head: bool) -> None:
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False) if own_head else None


class MtpModule(nn.Module):
    """One MTP module. `step(embeds, positions, hidden, attend)` -> the output stream [n, H] (before
    the shared head's norm: the next chained step reads it as its `hidden`); `logits(out)` -> fp32
    logits over the target's vocabulary."""

    def __init__(self, weights: MtpWeights) -> None:
        super().__init__()
        cfg, t = weights.config, weights.tensors
        for k in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if not getattr(cfg, k, None):
                raise MtpCheckpointError(f"{weights.path!r}: the config lacks {k!r}: not a latent-attention (MLA) "
                                         "DeepSeek model")
        h = cfg.hidden_size
        self.enorm = RMSNorm(h, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(h, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        if "mlp.gate.weight" in t:
            mlp = Moe(cfg, "mlp.gate.e_score_correction_bias" in t,
                      any(n.startswith("mlp.shared_experts.") for n in t))
        else:
            mlp = Mlp(h, t["mlp.gate_proj.weight"].shape[0] if "mlp.gate_proj.weight" in t else cfg.intermediate_size)
        self.layer = DecoderLayer(cfg, mlp)
        self.shared_head = SharedHead(cfg, "shared_head.head.weight" in t)
        self.embed_tokens = nn.Embedding(*t["embed_tokens.weight"].shape) if "embed_tokens.weight" in t else None
        self._load(weights)

    @staticmethod
    def _param_name(name: str) -> str:
        """Checkpoint name (relative to the layer) -> ours: the decoder layer's tensors live under `layer.`."""
        for own in ("enorm.", "hnorm.", "eh_proj.", "shared_head.", "embed_tokens."):
            if name.startswith(own):
                return name
        return "layer." + name

    def _load(self, weights: MtpWeights) -> None:
        params = dict(self.named_parameters())
        t = dict(weights.tensors)
        # transformers-5 layouts stack the experts: split them back into per-expert tensors
        for stacked in ("mlp.experts.gate_up_proj", "mlp.experts.down_proj"):
            if stacked in t:
                w = t.pop(stacked)
                for e in range(w.shape[0]):
                    if stacked.endswith("gate_up_proj"):
                        gate, up = w[e].chunk(2, dim=0)
                        t[f"mlp.experts.{e}.gate_proj.weight"], t[f"mlp.experts.{e}.up_proj.weight"] = gate, up
                    else:
                        t[f"mlp.experts.{e}.down_proj.weight"] = w[e]
        for name, tensor in t.items():
            if name.endswith("rotary_emb.inv_freq"):
                continue
            ours = self._param_name(name)
            if ours not in params:
                raise MtpCheckpointError(f"{weights.path!r}: MTP tensor model.layers.{weights.layer}.{name} has no "
                                         "place in the MTP module")
            p = params.pop(ours)
            if p.shape != tensor.shape:
                raise MtpCheckpointError(f"{weights.path!r}: model.layers.{weights.layer}.{name} has shape "
                                         f"{tuple(tensor.shape)}, the config implies {tuple(p.shape)}")
            with torch.no_grad():
                p.copy_(tensor)
        if params:
            names = sorted(f"model.layers.{weights.layer}.{n.removeprefix('layer.')}" for n in params)
            raise MtpCheckpointError(f"{weights.path!r}: the MTP layer lacks {', '.join(names[:6])}"
                                     + (" ..." if len(names) > 6 else ""))

    def step(self, embeds: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor, attend: Attend) -> torch.Tensor:
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1))
        return self.layer(positions, x, attend)

    def logits(self, out: torch.Tensor, target_logits: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        h = self.shared_head.norm(out)
        if self.shared_head.head is not None:
            return self.shared_head.head(h).float()
        return target_logits(h)
