"""Reading an EAGLE draft checkpoint directory: config.json plus the weights, in the published layouts.

EAGLE-2 (SafeAILab EAGLE / SGLang `LlamaForCausalLMEagle`): `fc.weight` [H, 2H] (+ `fc.bias`),
`layers.{i}.self_attn.{q,k,v,o}_proj.weight`, `layers.{i}.mlp.{gate,up,down}_proj.weight`,
`layers.{i}.post_attention_layernorm.weight` (layer 0 has no input norm), optionally
`embed_tokens.weight`; the target's LM head reads its output.

EAGLE-3 (SGLang `LlamaForCausalLMEagle3`): `fc.weight` [H, 3 * target_hidden], `midlayer.*` (one
decoder layer whose attention reads [embed, hidden], 2H wide, with `input_layernorm` over the
embedding and `hidden_norm` over the hidden state), `norm.weight`, `lm_head.weight` over
`draft_vocab_size` tokens, `d2t` (draft id -> target id offset) and `t2d`, optionally
`embed_tokens.weight`. Names may carry a `model.` prefix."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

KEY = "speculative.draft_model_path"


@dataclass
class EagleCheckpoint:
    version: int  # 2 or 3
    config: Any  # the config.json as attributes (what the rotary layer and the head read)
    tensors: dict[str, torch.Tensor]  # names without any `model.` prefix

    @property
    def num_layers(self) -> int:
        if self.version == 3:
            return 1
        return 1 + max(int(n.split(".")[1]) for n in self.tensors if n.startswith("layers."))


def _read_tensors(root: Path) -> dict[str, torch.Tensor]:
    files = sorted(root.glob("*.safetensors"))
    out: dict[str, torch.Tensor] = {}
    if files:
        from safetensors.torch import load_file

        for f in files:
            out.update(load_file(str(f)))
    else:
        bins = sorted(root.glob("pytorch_model*.bin"))
        if not bins:
            raise ValueError(f"{KEY}={str(root)!r}: no *.safetensors or pytorch_model*.bin weights there")
        for f in bins:
            out.update(torch.load(str(f), map_location="cpu", weights_only=True))
    return {(n[len("model."):] if n.startswith("model.") else n): t for n, t in out.items()}


def load_checkpoint(path: str | None) -> EagleCheckpoint:
    """The draft checkpoint at `path`; ValueError naming the config key when it is missing or not
    an EAGLE-2/EAGLE-3 layout."""
    if not path:
        raise ValueError(f"the eagle drafter needs a draft checkpoint: set {KEY}")
    root = Path(path)
    cfg_file = root / "config.json"
    if not cfg_file.is_file():
        raise ValueError(f"{KEY}={path!r}: no config.json there")
    try:
        raw = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{KEY}={path!r}: config.json is not JSON ({e})") from None
    tensors = _read_tensors(root)
    if any(n.startswith("midlayer.") for n in tensors):
        version = 3
    elif any(n.startswith("layers.0.") for n in tensors):
        version = 2
    else:
        raise ValueError(f"{KEY}={path!r}: neither an EAGLE-2 (layers.0.*) nor an EAGLE-3 (midlayer.*) checkpoint")
    if "fc.weight" not in tensors:
        raise ValueError(f"{KEY}={path!r}: the checkpoint has no fc.weight")
    for k in ("hidden_size", "num_attention_heads", "intermediate_size"):
        if k not in raw:
            raise ValueError(f"{KEY}={path!r}: config.json lacks {k!r}")
    raw.setdefault("num_key_value_heads", raw["num_attention_heads"])
    raw.setdefault("rms_norm_eps", 1e-6)
    if not raw.get("head_dim"):
        raw["head_dim"] = raw["hidden_size"] // raw["num_attention_heads"]
    return EagleCheckpoint(version, SimpleNamespace(**raw), tensors)


def default_aux_layers(config: Any, num_target_layers: int) -> tuple[int, ...]:
    """EAGLE-3's three target layers (0-based, the output of each): the checkpoint's
    `eagle_config.eagle_aux_hidden_state_layer_ids` when given, else low / middle / high as SGLang
    picks them (after layers 1, L/2 - 1 and L - 4), clamped into tiny targets."""
    eagle_cfg = getattr(config, "eagle_config", None) or {}
    ids = eagle_cfg.get("eagle_aux_hidden_state_layer_ids") if isinstance(eagle_cfg, dict) else None
    if ids:
        return tuple(int(i) for i in ids)
    n = num_target_layers
    return tuple(min(max(i, 0), n - 1) for i in (1, n // 2 - 1, n - 4))
