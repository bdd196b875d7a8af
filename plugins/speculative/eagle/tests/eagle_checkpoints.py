"""Tiny EAGLE-2 / EAGLE-3 draft checkpoints in the published layouts (config.json + safetensors)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file


def _cfg(target: dict, **extra) -> dict:
    keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            "vocab_size", "max_position_embeddings", "rms_norm_eps", "rope_theta")
    return {**{k: target[k] for k in keys if k in target}, "num_hidden_layers": 1, "model_type": "llama", **extra}


def _layer(prefix: str, cfg: dict, width: int, gen: torch.Generator, input_norm: bool, hidden_norm: bool) -> dict:
    h, hd, inter = cfg["hidden_size"], cfg["head_dim"], cfg["intermediate_size"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]

    def rnd(*shape):
        return 0.1 * torch.randn(*shape, generator=gen)

    t = {
        f"{prefix}.self_attn.q_proj.weight": rnd(nh * hd, width),
        f"{prefix}.self_attn.k_proj.weight": rnd(nkv * hd, width),
        f"{prefix}.self_attn.v_proj.weight": rnd(nkv * hd, width),
        f"{prefix}.self_attn.o_proj.weight": rnd(h, nh * hd),
        f"{prefix}.mlp.gate_proj.weight": rnd(inter, h),
        f"{prefix}.mlp.up_proj.weight": rnd(inter, h),
        f"{prefix}.mlp.down_proj.weight": rnd(h, inter),
        f"{prefix}.post_attention_layernorm.weight": 1 + rnd(h),
    }
    if input_norm:
        t[f"{prefix}.input_layernorm.weight"] = 1 + rnd(h)
    if hidden_norm:
        t[f"{prefix}.hidden_norm.weight"] = 1 + rnd(h)
    return t


def _save(path: str | Path, cfg: dict, tensors: dict) -> str:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    return str(path)


def target_config(target_dir: str) -> dict:
    return json.loads((Path(target_dir) / "config.json").read_text())


def write_eagle2(path, target: dict, seed: int = 0, num_layers: int = 1) -> str:
    """EAGLE-2: fc [H, 2H] + bias, `layers.{i}.*` (layer 0 without input norm), no head of its own."""
    cfg = _cfg(target, architectures=["LlamaForCausalLMEagle"], num_hidden_layers=num_layers)
    gen = torch.Generator().manual_seed(seed)
    h = cfg["hidden_size"]
    t = {"fc.weight": 0.1 * torch.randn(h, 2 * h, generator=gen), "fc.bias": 0.1 * torch.randn(h, generator=gen)}
    for i in range(num_layers):
        t.update(_layer(f"layers.{i}", cfg, h, gen, input_norm=i > 0, hidden_norm=False))
    return _save(path, cfg, t)


def write_eagle3(path, target: dict, seed: int = 0, draft_vocab: int = 256, aux_layers=(0, 1, 2)) -> str:
    """EAGLE-3: fc [H, 3H], `midlayer.*` reading [embed, hidden] (2H), norm, lm_head over a reduced
    vocabulary, d2t (draft id -> target id offset) and t2d (target ids kept)."""
    cfg = _cfg(target, architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=draft_vocab,
               eagle_config={"eagle_aux_hidden_state_layer_ids": list(aux_layers)})
    gen = torch.Generator().manual_seed(seed)
    h, vocab = cfg["hidden_size"], cfg["vocab_size"]
    kept = torch.randperm(vocab, generator=gen)[:draft_vocab].sort().values  # the draft's target ids
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[kept] = True
    t = {
        "fc.weight": 0.1 * torch.randn(h, 3 * h, generator=gen),
        "norm.weight": 1 + 0.1 * torch.randn(h, generator=gen),
        "lm_head.weight": 0.3 * torch.randn(draft_vocab, h, generator=gen),
        "d2t": kept - torch.arange(draft_vocab),
        "t2d": t2d,
    }
    t.update(_layer("midlayer", cfg, 2 * h, gen, input_norm=True, hidden_norm=True))
    return _save(path, cfg, t)


def write_eagle2_copy(path, target_dir: str) -> str:
    """An EAGLE-2 head that computes what a 1-layer target computes: fc passes the token embedding
    through, draft layer 0 adds nothing (zero o_proj and down_proj), draft layer 1 is the target's
    layer. The target's LM head then reads the target's own pre-norm stream, so with a final norm
    of ones its argmax is the target's next token (up to the draft missing position 0's token)."""
    from safetensors.torch import load_file

    target = target_config(target_dir)
    assert target["num_hidden_layers"] == 1
    tw = {}
    for f in Path(target_dir).glob("*.safetensors"):
        tw.update(load_file(str(f)))
    cfg = _cfg(target, architectures=["LlamaForCausalLMEagle"], num_hidden_layers=2)
    gen = torch.Generator().manual_seed(0)
    h = cfg["hidden_size"]
    t = {"fc.weight": torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1), "fc.bias": torch.zeros(h)}
    t.update(_layer("layers.0", cfg, h, gen, input_norm=False, hidden_norm=False))
    t["layers.0.self_attn.o_proj.weight"].zero_()
    t["layers.0.mlp.down_proj.weight"].zero_()
    for name, w in tw.items():
        if name.startswith("model.layers.0."):
            t[name.replace("model.layers.0.", "layers.1.")] = w
    return _save(path, cfg, t)
