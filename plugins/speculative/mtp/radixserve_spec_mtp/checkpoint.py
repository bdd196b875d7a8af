"""Reading a DeepSeek-V3 checkpoint's multi-token-prediction (MTP, "NextN") layer.

DeepSeek-V3 checkpoints store `num_nextn_predict_layers` MTP modules after the decoder, as
`model.layers.{num_hidden_layers + i}.*` (transformers builds no module for them and skips them):

- `enorm.weight`, `hnorm.weight`: RMSNorms of the next token's embedding and of the target's hidden state
- `eh_proj.weight` `[H, 2H]`: projects `cat(enorm(embed), hnorm(hidden))` (embedding first)
- one full decoder layer: `input_layernorm`, `self_attn.*` (MLA), `post_attention_layernorm`,
  `mlp.*` (MoE: `gate.weight`, `gate.e_score_correction_bias`, `experts.{e}.{gate,up,down}_proj`,
  `shared_experts.*`; or a dense MLP)
- `shared_head.norm.weight` and, optionally, `shared_head.head.weight` `[V, H]` and `embed_tokens.weight`
  (checkpoints that share them with the target may leave them out: the target's are used)

Only the tensors of that layer are read (through the safetensors index when there is one)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

KEY = "speculative.draft_model_path"

# what every MTP layer must carry, besides its attention and MLP
REQUIRED = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
            "input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.kv_a_proj_with_mqa.weight",
            "self_attn.kv_a_layernorm.weight", "self_attn.kv_b_proj.weight", "self_attn.o_proj.weight")


class MtpCheckpointError(ValueError):
    """The checkpoint has no usable MTP layer (the message names the path and what is missing)."""


@dataclass
class MtpWeights:
    config: Any  # the HF config (DeepseekV3Config or one with the same fields)
    layer: int  # the checkpoint layer index of the MTP module (num_hidden_layers + i)
    tensors: dict[str, torch.Tensor]  # names relative to `model.layers.{layer}.`
    path: str


def num_mtp_layers(config: Any) -> int:
    return int(getattr(config, "num_nextn_predict_layers", 0) or 0)


def _files(root: Path, prefix: str) -> list[Path]:
    """The safetensors files holding tensors under `prefix` (all of them when there is no index)."""
    index = root / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        names = sorted({f for n, f in weight_map.items() if n.startswith(prefix)})
        return [root / n for n in names]
    return sorted(root.glob("*.safetensors"))


def read_mtp_layer(path: str | None, config: Any, index: int = 0) -> MtpWeights:
    """The tensors of MTP module `index` of the checkpoint at `path`, whose HF config is `config`.

    Raises MtpCheckpointError naming the checkpoint when the config declares no MTP layer
    (`num_nextn_predict_layers` 0 or absent), when `index` is beyond them, or when the layer's
    tensors are missing from the weights (a checkpoint saved by transformers drops them)."""
    if not path:
        raise MtpCheckpointError(f"the mtp drafter needs the checkpoint directory (model.path or {KEY})")
    root = Path(path)
    if not root.is_dir():
        raise MtpCheckpointError(f"{KEY}={path!r}: not a directory (the mtp drafter reads local safetensors)")
    n = num_mtp_layers(config)
    if n == 0:
        raise MtpCheckpointError(
            f"{path!r} has no multi-token-prediction layer: its config's num_nextn_predict_layers is "
            f"{getattr(config, 'num_nextn_predict_layers', None)!r} (stack.speculative=mtp needs a DeepSeek-V3-style "
            "checkpoint with MTP weights; use eagle or ngram otherwise)")
    if not 0 <= index < n:
        raise MtpCheckpointError(f"{path!r}: MTP layer {index} requested, the checkpoint has {n}")
    layer = int(config.num_hidden_layers) + index
    prefix = f"model.layers.{layer}."
    from safetensors import safe_open

    tensors: dict[str, torch.Tensor] = {}
    for f in _files(root, prefix):
        with safe_open(str(f), framework="pt") as sf:
            for name in sf.keys():
                if name.startswith(prefix):
                    tensors[name[len(prefix):]] = sf.get_tensor(name)
    tensors = dequantize_fp8_blocks(tensors, config, path)
    missing = [k for k in REQUIRED if k not in tensors]
    if not tensors or missing:
        what = "no tensors" if not tensors else f"not {', '.join(missing)}"
        raise MtpCheckpointError(
            f"{path!r}: num_nextn_predict_layers={n} but the weights hold {what} under {prefix}* (the MTP layer's "
            "tensors are missing: checkpoints re-saved by transformers drop them)")
    return MtpWeights(config, layer, tensors, str(path))


def dequantize_fp8_blocks(tensors: dict[str, torch.Tensor], config: Any, path: str) -> dict[str, torch.Tensor]:
    """Block-FP8 weights (DeepSeek-V3's release: `X.weight` in float8 with `X.weight_scale_inv`, one
    fp32 scale per `weight_block_size` tile) -> fp32 weights; other tensors pass through. The MTP
    layer then runs in the model dtype (its experts unquantized: memory, not speed, is the cost)."""
    scales = {n[: -len("_scale_inv")]: n for n in tensors if n.endswith(".weight_scale_inv")}
    if not scales:
        return tensors
    qcfg = getattr(config, "quantization_config", None) or {}
    qcfg = qcfg if isinstance(qcfg, dict) else vars(qcfg)
    bo, bi = (int(x) for x in (qcfg.get("weight_block_size") or (128, 128)))
    out = {n: t for n, t in tensors.items() if not n.endswith(".weight_scale_inv")}
    for name, scale_name in scales.items():
        if name not in out:
            raise MtpCheckpointError(f"{path!r}: {scale_name} without its weight {name}")
        w, s = out[name].to(torch.float32), tensors[scale_name].to(torch.float32)
        want = (-(-w.shape[0] // bo), -(-w.shape[1] // bi))
        if s.numel() != 1 and tuple(s.shape) != want:
            raise MtpCheckpointError(f"{path!r}: {scale_name} has shape {tuple(s.shape)}, a {tuple(w.shape)} weight in "
                                     f"{bo}x{bi} blocks needs {want}")
        full = s if s.numel() == 1 else s.repeat_interleave(bo, 0).repeat_interleave(bi, 1)[: w.shape[0], : w.shape[1]]
        out[name] = w * full
    return out


def load_config(path: str) -> Any:
    """The HF config at `path` (for a draft_model_path that differs from the target's)."""
    from transformers import AutoConfig

    if not (Path(path) / "config.json").is_file():
        raise MtpCheckpointError(f"{KEY}={path!r}: no config.json there")
    return AutoConfig.from_pretrained(path)
