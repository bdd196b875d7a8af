"""Tiny random DeepSeek-V3 checkpoints with a multi-token-prediction layer, as the published ones
store it: transformers builds (and saves) no MTP module, so its tensors are generated here and
written into the checkpoint's safetensors under `model.layers.{num_hidden_layers}.*`, in the
on-disk layout of DeepSeek-V3 (per-expert `experts.{e}.{gate,up,down}_proj.weight`)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from radixserve.testing import tiny_checkpoint
from safetensors.torch import load_file, save_file

# MLA and MoE dimensions of a tiny V3 (num_key_value_heads = heads as in DeepSeek's own configs)
TINY_V3 = dict(
    q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, head_dim=8,
    n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_group=2, topk_group=1,
    n_shared_experts=1, first_k_dense_replace=1, num_key_value_heads=4, num_nextn_predict_layers=1,
)


def _config(path: str):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path)


def hf_decoder_layer_tensors(config, layer: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Random tensors for a DeepSeek-V3 decoder layer at index `layer` (MoE when layer >=
    first_k_dense_replace), named as on disk, relative to the layer."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer

    module = DeepseekV3DecoderLayer(config, layer)
    out: dict[str, torch.Tensor] = {}
    for name, t in module.state_dict().items():
        if name.endswith("norm.weight"):
            val = 1 + 0.1 * torch.randn(t.shape, generator=gen)
        elif name.endswith("e_score_correction_bias"):
            val = 0.05 * torch.randn(t.shape, generator=gen)
        else:
            val = 0.1 * torch.randn(t.shape, generator=gen)
        if name == "mlp.experts.gate_up_proj":  # transformers 5 stacks experts; checkpoints do not
            for e in range(val.shape[0]):
                gate, up = val[e].chunk(2, dim=0)
                out[f"mlp.experts.{e}.gate_proj.weight"], out[f"mlp.experts.{e}.up_proj.weight"] = gate, up
        elif name == "mlp.experts.down_proj":
            for e in range(val.shape[0]):
                out[f"mlp.experts.{e}.down_proj.weight"] = val[e]
        else:
            out[name] = val
    return out


def mtp_tensors(config, gen: torch.Generator, own_head: bool = True) -> dict[str, torch.Tensor]:
    """A random MTP module (relative names): enorm, hnorm, eh_proj, a decoder layer, the shared head."""
    h, v = config.hidden_size, config.vocab_size
    t = hf_decoder_layer_tensors(config, config.num_hidden_layers, gen)
    t["enorm.weight"] = 1 + 0.1 * torch.randn(h, generator=gen)
    t["hnorm.weight"] = 1 + 0.1 * torch.randn(h, generator=gen)
    t["eh_proj.weight"] = 0.1 * torch.randn(h, 2 * h, generator=gen)
    t["shared_head.norm.weight"] = 1 + 0.1 * torch.randn(h, generator=gen)
    if own_head:
        t["shared_head.head.weight"] = 0.3 * torch.randn(v, h, generator=gen)
        t["embed_tokens.weight"] = torch.randn(v, h, generator=gen)
    return t


def _append(path: str, layer: int, tensors: dict[str, torch.Tensor]) -> None:
    f = Path(path) / "model.safetensors"
    weights = load_file(str(f))
    weights.update({f"model.layers.{layer}.{k}": v.contiguous() for k, v in tensors.items()})
    save_file(weights, str(f), metadata={"format": "pt"})


def write_tiny_v3_with_mtp(path, seed: int = 0, own_head: bool = True, **overrides) -> str:
    """A tiny random DeepseekV3ForCausalLM (2 layers unless overridden) plus one MTP layer."""
    path = tiny_checkpoint("deepseek_v3", str(path), seed=seed, **{**TINY_V3, **overrides})
    cfg = _config(path)
    _append(path, cfg.num_hidden_layers, mtp_tensors(cfg, torch.Generator().manual_seed(seed + 100), own_head))
    return path


def write_tiny_v3_without_mtp(path, seed: int = 0, declared: int = 0) -> str:
    """A tiny V3 whose config declares `declared` MTP layers but whose weights hold none."""
    return tiny_checkpoint("deepseek_v3", str(path), seed=seed, **{**TINY_V3, "num_nextn_predict_layers": declared})


def write_copy_target(path, seed: int = 0) -> str:
    """A 1-layer tiny V3 whose MTP layer reproduces the target: the embedding rows have RMS 1 and
    enorm is ones (so enorm(embed) == embed), eh_proj passes the embedding through, the decoder
    layer is the target's layer 0, shared_head.norm is the target's final norm and the head is the
    target's (none of its own). The MTP row at position p then computes the target's state at p + 1
    from token p + 1, up to missing token 0 (relative rotary positions are the same)."""
    path = tiny_checkpoint("deepseek_v3", str(path), seed=seed, **{**TINY_V3, "num_hidden_layers": 1})
    f = Path(path) / "model.safetensors"
    w = load_file(str(f))
    emb = w["model.embed_tokens.weight"]
    w["model.embed_tokens.weight"] = emb / emb.pow(2).mean(-1, keepdim=True).sqrt()
    if "lm_head.weight" not in w:  # tied
        raise AssertionError("the copy target expects an untied LM head")
    h = emb.shape[1]
    mtp = {k[len("model.layers.0."):]: v.clone() for k, v in w.items() if k.startswith("model.layers.0.")}
    mtp["enorm.weight"] = torch.ones(h)
    mtp["hnorm.weight"] = torch.ones(h)
    mtp["eh_proj.weight"] = torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1)
    mtp["shared_head.norm.weight"] = w["model.norm.weight"].clone()
    w.update({f"model.layers.1.{k}": v.contiguous() for k, v in mtp.items()})
    save_file(w, str(f), metadata={"format": "pt"})
    cfg = json.loads((Path(path) / "config.json").read_text())
    assert cfg["num_nextn_predict_layers"] == 1
    return path
