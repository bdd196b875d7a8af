"""GGUF tensors -> (HF name, dequantized fp32 torch tensor)."""

from __future__ import annotations

import re
from collections.abc import Iterator

import numpy as np
import torch

# llama.cpp block-level names -> HF names (per layer)
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# the decoder linears (the layers a QuantMethod computes)
LINEAR_SUFFIXES = tuple(f".{n}.weight" for n in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up",
                                                  "ffn_down"))
_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")


def hf_name(gguf_name: str) -> str | None:
    """The HF parameter name of a GGUF tensor, or None for tensors HF models do not have."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _BLOCK.match(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
    return None


_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_GGUF_GLOBAL = {hf: own for own, hf in _GLOBAL_NAMES.items()}
_GGUF_LAYER = {hf: own for own, hf in _LAYER_NAMES.items()}


def gguf_name(name: str) -> str | None:
    """The GGUF tensor a model parameter or HF tensor name comes from (`model.layers.1.mlp.down_proj.weight`
    -> `blk.1.ffn_down.weight`; a kept linear's own parameter, `...down_proj.qweight`, as its weight), or None."""
    base = name.rsplit(".", 1)[0] + ".weight" if not name.endswith((".weight", ".bias")) else name
    if base in _GGUF_GLOBAL:
        return _GGUF_GLOBAL[base]
    m = _HF_LAYER.match(base)
    if m and m.group(2) in _GGUF_LAYER:
        return f"blk.{m.group(1)}.{_GGUF_LAYER[m.group(2)]}"
    return None


def unpermute_qk(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (it stores each head's rotary halves interleaved)."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def dequantize(t) -> torch.Tensor:
    """fp32 tensor in HF [out, in] order from a GGUF ReaderTensor."""
    from gguf.quants import dequantize as gguf_dequantize

    kind = t.tensor_type.name
    if kind not in SUPPORTED_TYPES:
        from radixserve_quant_gguf.hf_config import UnsupportedGGUF

        raise UnsupportedGGUF(f"GGUF tensor {t.name!r} has type {kind}; supported: {', '.join(SUPPORTED_TYPES)}")
    arr = gguf_dequantize(t.data, t.tensor_type)
    shape = tuple(int(x) for x in reversed(t.shape))  # GGUF lists dims innermost first
    arr = np.ascontiguousarray(arr, dtype=np.float32).reshape(shape)
    if not arr.flags.writeable:  # F32/F16 tensors come straight from the read-only memmap
        arr = arr.copy()
    return torch.from_numpy(arr)


def iter_hf_tensors(reader, arch: str, num_heads: int, num_kv_heads: int, only=None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, fp32 tensor) for every tensor an HF model has (`only`: just that one tensor)."""
    for t in reader.tensors if only is None else [only]:
        name = hf_name(t.name)
        if name is None:
            continue
        w = dequantize(t)
        if arch == "llama" and name.endswith("q_proj.weight"):
            w = unpermute_qk(w, num_heads)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            w = unpermute_qk(w, num_kv_heads)
        yield name, w
