"""The EAGLE draft network: `fc` fusing the target's features, Llama decoder layer(s), and the
head that turns the draft's output into draft log-probabilities over target token ids.

Attention is delegated to an `attend(layer, q, k, v)` callable so the draft KV lives wherever the
drafter keeps it (its own pool, see kv_pool.py).

One-row matmuls (a batch-1 chain step, a single verified row) run on the target's batch-1 Triton
GEMV when `attach_batch1_gemv` gave their weight a tile (radixserve.layers.gemv_selection: the same
per-shape choice as the target's layers), so a chain propose pays no cuBLAS split-K reductions."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from radixserve.layers import triton_gemv
from radixserve.layers.gemv_selection import batch1_gemv_enabled, gemv_config_for_shape
from radixserve.layers.norm import RMSNorm
from radixserve.layers.rotary import get_rope

from radixserve_spec_eagle.checkpoint import KEY, EagleCheckpoint

Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
_GEMV_DTYPES = (torch.bfloat16, torch.float16)


def draft_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 tile: triton_gemv.GemvConfig | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`; a one-row `x` runs on the Triton GEMV when `tile` is set."""
    if tile is not None and x.dim() == 2 and x.shape[0] == 1:
        return triton_gemv.gemv(x, weight, bias, tile)
    return F.linear(x, weight, bias)


def gemv_tile(weight: torch.Tensor | None, enabled: bool) -> triton_gemv.GemvConfig | None:
    """The batch-1 GEMV tile of a draft weight (the target's per-shape choice), or None (cuBLAS)."""
    if not enabled or weight is None or weight.dim() != 2 or weight.dtype not in _GEMV_DTYPES or weight.stride(1) != 1:
        return None
    return gemv_config_for_shape(*weight.shape)


class DraftLayer(nn.Module):
    """A Llama decoder layer. EAGLE-2: reads the fused stream (layer 0 without input norm).
    EAGLE-3: reads [input_layernorm(embed), hidden_norm(hidden)], so q/k/v are 2H wide."""

    def __init__(self, cfg, index: int, eagle3: bool, input_norm: bool) -> None:
        super().__init__()
        h, hd = cfg.hidden_size, cfg.head_dim
        self.index, self.eagle3 = index, eagle3
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, hd
        width = 2 * h if eagle3 else h
        bias = bool(getattr(cfg, "attention_bias", False))
        self.q_proj = nn.Linear(width, self.num_heads * hd, bias=bias)
        self.k_proj = nn.Linear(width, self.num_kv_heads * hd, bias=bias)
        self.v_proj = nn.Linear(width, self.num_kv_heads * hd, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * hd, h, bias=False)
        self.gate_proj = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, h, bias=False)
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps) if input_norm else None
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps) if eagle3 else None
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.rotary_emb = get_rope(cfg, hd)
        # set by fuse_projections(); None: the separate projections run
        for name in ("qkv_weight", "qkv_bias", "gate_up_weight"):
            self.register_buffer(name, None, persistent=False)
        self.tiles: dict[str, triton_gemv.GemvConfig | None] = {}  # set by EagleHead.attach_batch1_gemv

    def forward(self, positions: torch.Tensor, x: torch.Tensor, embeds: torch.Tensor | None, attend: Attend):
        """x: the incoming stream [n, H]; returns the outgoing stream (attention and MLP added)."""
        residual = x
        if self.eagle3:
            h = torch.cat([self.input_layernorm(embeds), self.hidden_norm(x)], dim=-1)
        else:
            h = self.input_layernorm(x) if self.input_layernorm is not None else x
        n = h.shape[0]
        if self.qkv_weight is not None:  # one matmul over the shared (2H-wide for EAGLE-3) input
            qkv = draft_linear(h, self.qkv_weight, self.qkv_bias, self.tiles.get("qkv"))
            q, k, v = qkv.split(self._qkv_split, dim=-1)
            q, k = self.rotary_emb(positions, q.contiguous(), k.contiguous())
            v = v.contiguous()
        else:
            q, k = self.rotary_emb(positions, self.q_proj(h), self.k_proj(h))
            v = self.v_proj(h)
        out = attend(
            self.index, q.view(n, self.num_heads, self.head_dim), k.view(n, self.num_kv_heads, self.head_dim),
            v.view(n, self.num_kv_heads, self.head_dim),
        )
        o = draft_linear(out.reshape(n, -1), self.o_proj.weight, None, self.tiles.get("o"))
        h, residual = self.post_attention_layernorm(o, residual)
        if self.gate_up_weight is not None:
            gate, up = draft_linear(h, self.gate_up_weight, None, self.tiles.get("gate_up")).chunk(2, dim=-1)
            return draft_linear(F.silu(gate) * up, self.down_proj.weight, None, self.tiles.get("down")) + residual
        return self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h)) + residual

    def fuse_projections(self) -> None:
        """Concatenate q/k/v and gate/up into one weight each (fewer, larger GEMVs at batch 1: the
        small k/v and the two MLP matmuls run far from HBM speed alone). The separate parameters
        become views of the fused tensors (no extra memory). Call after the final `.to(...)`: a
        later move keeps the results right but copies the views apart."""
        with torch.no_grad():
            qkv = torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight])
            self._qkv_split = [self.q_proj.out_features, self.k_proj.out_features, self.v_proj.out_features]
            bias = None
            if self.q_proj.bias is not None:
                bias = torch.cat([self.q_proj.bias, self.k_proj.bias, self.v_proj.bias])
            gate_up = torch.cat([self.gate_proj.weight, self.up_proj.weight])
            self.qkv_weight, self.qkv_bias, self.gate_up_weight = qkv, bias, gate_up
            a, b, _ = self._qkv_split
            self.q_proj.weight.data = qkv[:a]
            self.k_proj.weight.data = qkv[a:a + b]
            self.v_proj.weight.data = qkv[a + b:]
            if bias is not None:
                self.q_proj.bias.data, self.k_proj.bias.data, self.v_proj.bias.data = bias[:a], bias[a:a + b], bias[a + b:]
            i = self.gate_proj.out_features
            self.gate_proj.weight.data, self.up_proj.weight.data = gate_up[:i], gate_up[i:]

    def attach_batch1_gemv(self, enabled: bool) -> int:
        """Pick the GEMV tiles of this layer's o / down and (when fused) qkv / gate_up weights;
        returns how many got one."""
        self.tiles = {"qkv": gemv_tile(self.qkv_weight, enabled), "o": gemv_tile(self.o_proj.weight, enabled),
                      "gate_up": gemv_tile(self.gate_up_weight, enabled),
                      "down": gemv_tile(self.down_proj.weight, enabled)}
        return sum(t is not None for t in self.tiles.values())


class EagleHead(nn.Module):
    """One EAGLE draft model. `step(...)` runs rows through it; `log_probs(out)` gives draft
    log-probabilities and the target token id of each column."""

    def __init__(self, ckpt: EagleCheckpoint, target_vocab: int) -> None:
        super().__init__()
        cfg, t = ckpt.config, ckpt.tensors
        self.version = ckpt.version
        self.hidden_size = cfg.hidden_size
        eagle3 = ckpt.version == 3
        if eagle3:
            fc_in = t["fc.weight"].shape[1]
            self.fc = nn.Linear(fc_in, cfg.hidden_size, bias="fc.bias" in t)
            self.layers = nn.ModuleList([DraftLayer(cfg, 0, True, True)])
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            has_head = "lm_head.weight" in t
            self.lm_head = nn.Linear(cfg.hidden_size, t["lm_head.weight"].shape[0], bias=False) if has_head else None
        else:
            self.fc = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias="fc.bias" in t)
            self.layers = nn.ModuleList(DraftLayer(cfg, i, False, i > 0) for i in range(ckpt.num_layers))
            self.norm, self.lm_head = None, None
        self.embed_tokens = nn.Embedding(*t["embed_tokens.weight"].shape) if "embed_tokens.weight" in t else None
        # draft id -> target id (EAGLE-3 reduced vocabularies); None: the draft's ids are target ids
        self.register_buffer("draft_to_target", None)
        self.tiles: dict[str, triton_gemv.GemvConfig | None] = {}  # set by attach_batch1_gemv
        if eagle3 and "d2t" in t:
            d2t = t["d2t"].to(torch.int64)
            self.draft_to_target = d2t + torch.arange(d2t.shape[0])
        self._load(ckpt, target_vocab)

    def _load(self, ckpt: EagleCheckpoint, target_vocab: int) -> None:
        params = dict(self.named_parameters())
        for name, tensor in ckpt.tensors.items():
            if name in ("d2t", "t2d") or name.endswith("rotary_emb.inv_freq") or (
                self.version == 2 and name == "lm_head.weight"  # EAGLE-2 reads the target's head
            ):
                continue
            ours = name.replace("midlayer.", "layers.0.").replace("self_attn.", "").replace("mlp.", "")
            if ours not in params:
                raise ValueError(f"{KEY}: checkpoint tensor {name!r} has no place in an EAGLE-{self.version} head")
            p = params.pop(ours)
            if p.shape != tensor.shape:
                raise ValueError(f"{KEY}: {name!r} has shape {tuple(tensor.shape)}, the config implies {tuple(p.shape)}")
            with torch.no_grad():
                p.copy_(tensor)
        if params:
            raise ValueError(f"{KEY}: the checkpoint lacks {sorted(params)}")
        if self.draft_to_target is not None:
            bad = (self.draft_to_target < 0) | (self.draft_to_target >= target_vocab)
            if bool(bad.any()):
                raise ValueError(f"{KEY}: d2t maps draft ids outside the target's vocabulary of {target_vocab}")

    def fuse_projections(self) -> None:
        """Fuse every draft layer's q/k/v and gate/up matmuls (see DraftLayer.fuse_projections)."""
        for layer in self.layers:
            layer.fuse_projections()

    def attach_batch1_gemv(self, mode: str, device: torch.device) -> int:
        """Route the one-row matmuls of fc, every layer's projections and the draft LM head
        through the batch-1 Triton GEMV where `runtime.batch1_gemv = mode` would route the
        target's (radixserve.layers.gemv_selection); returns how many weights got a tile. Call
        after the final `.to(...)` and `fuse_projections()`, before capturing CUDA graphs. Raises
        ValueError for an unknown mode."""
        enabled = batch1_gemv_enabled(mode, torch.device(device))
        self.tiles = {"fc": gemv_tile(self.fc.weight, enabled),
                      "lm_head": gemv_tile(self.lm_head.weight if self.lm_head is not None else None, enabled)}
        return sum(t is not None for t in self.tiles.values()) + sum(
            layer.attach_batch1_gemv(enabled) for layer in self.layers)

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """EAGLE-3: the three target layers [n, 3H'] -> the draft's hidden size; a draft output (H
        wide already) passes unchanged."""
        if self.version == 3 and features.shape[-1] != self.hidden_size:
            return draft_linear(features, self.fc.weight, self.fc.bias, self.tiles.get("fc"))
        return features

    def step(self, embeds: torch.Tensor, positions: torch.Tensor, features: torch.Tensor, attend: Attend) -> torch.Tensor:
        """Rows of (token embedding, feature) at `positions` -> the draft's output stream [n, H], which
        is both the next step's feature and what `log_probs` reads."""
        if self.version == 2:
            x = draft_linear(torch.cat([embeds, features], dim=-1), self.fc.weight, self.fc.bias, self.tiles.get("fc"))
            for layer in self.layers:
                x = layer(positions, x, None, attend)
            return x
        return self.layers[0](positions, self.fuse(features), embeds, attend)

    def log_probs(self, out: torch.Tensor, target_logits: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """fp32 log-probabilities [n, draft vocab]: EAGLE-2 through the target's LM head, EAGLE-3
        through its own norm and head (the target's when the checkpoint has none)."""
        return torch.log_softmax(self.logits(out, target_logits).float(), dim=-1)

    def logits(self, out: torch.Tensor, target_logits: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """Raw draft logits [n, draft vocab] (model dtype): enough for a greedy chain's argmax, which
        needs no log-softmax over the vocabulary."""
        if self.version == 2:
            return target_logits(out)
        h = self.norm(out)
        if self.lm_head is not None:
            return draft_linear(h, self.lm_head.weight, None, self.tiles.get("lm_head"))
        return target_logits(h)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids if self.draft_to_target is None else self.draft_to_target[draft_ids]
