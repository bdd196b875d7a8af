"""Tiny quantized checkpoints in the published AWQ / GPTQ / HF-fp8 layouts, built here (nothing can
be downloaded), plus each format's dequantization written straight from its reference code.

No maintained reader of these formats installs without CUDA (autoawq, auto-gptq and gptqmodel
ship CUDA extensions), so the packers below are written independently of the plugins' unpackers,
from the formats' reference code read for this purpose (not copied):
- AWQ: AutoAWQ `WQLinear_GEMM.from_linear` packs 8 codes per int32 along the output dim with
  `order_map = [0, 2, 4, 6, 1, 3, 5, 7]` (nibble i holds column 8c + order_map[i]); qzeros the same;
  scales [in/g, out] fp16; w = (q - z) * s.
- GPTQ: AutoGPTQ `QuantLinear.pack` packs rows k..k+7 of the [in, out] codes into one int32
  (row k + j at bits 4j); qzeros along the output dim, storing `zeros - 1` (checkpoint format v1,
  readers add 1 back); g_idx[k] is the group of input row k (with act-order: the groups are formed
  in GPTQ's column order); w = (q - (z + 1)) * s[g_idx].
- fp8: transformers' FineGrainedFP8 / DeepSeek-V3 `weight_scale_inv` [ceil(out/128), ceil(in/128)]
  (w = weight * scale of its block); AutoFP8's per-tensor scalar `weight_scale`.
The plugins' own unpackers are checked against these (tests/test_quant_formats.py)."""

from __future__ import annotations

import json
import os

import torch

AWQ_ORDER_MAP = [0, 2, 4, 6, 1, 3, 5, 7]
FP8_MAX = 448.0
DECODER_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# big enough that every format's block / group fits each layer (fp8 blocks are 128x128)
TINY_QUANT_CONFIG = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=64)


def _as_int32(v: torch.Tensor) -> torch.Tensor:
    v = v & 0xFFFFFFFF
    return torch.where(v >= 2**31, v - 2**32, v).to(torch.int32)


def _group_minmax_quant(w_in_out: torch.Tensor, g: int, zero_lo: int = 0):
    """Asymmetric 4-bit round-to-nearest per (group of g input rows, output column).
    Returns codes [in, out], zeros [G, out] (ints), fp16-representable scales [G, out]."""
    k, n = w_in_out.shape
    grouped = w_in_out.reshape(k // g, g, n)
    lo, hi = grouped.amin(1), grouped.amax(1)
    scales = ((hi - lo).clamp(min=1e-5) / 15).half().float()
    zeros = torch.round(-lo / scales).clamp(zero_lo, 15)
    codes = torch.clamp(torch.round(grouped / scales[:, None]) + zeros[:, None], 0, 15)
    return codes.reshape(k, n).long(), zeros.long(), scales


# ---- AWQ ---------------------------------------------------------------------------------------
def awq_pack_cols(codes: torch.Tensor) -> torch.Tensor:
    rows, cols = codes.shape
    out = torch.zeros(rows, cols // 8, dtype=torch.int64)
    for c in range(cols // 8):
        for i in range(8):
            out[:, c] |= codes[:, c * 8 + AWQ_ORDER_MAP[i]].long() << (4 * i)
    return _as_int32(out)


def awq_quantize(w: torch.Tensor, group_size: int):
    """w [out, in] fp32 -> ({qweight, qzeros, scales}, dequantized [out, in])."""
    codes, zeros, scales = _group_minmax_quant(w.T.contiguous(), group_size)
    deq = (codes.float() - zeros.repeat_interleave(group_size, 0).float()) * scales.repeat_interleave(group_size, 0)
    tensors = {"qweight": awq_pack_cols(codes), "qzeros": awq_pack_cols(zeros), "scales": scales.half()}
    return tensors, deq.T.contiguous()


def awq_reference_dequant(qweight, qzeros, scales, group_size: int) -> torch.Tensor:
    """[in, out] fp32 straight from the layout (bit by bit, loops): the independent reference."""
    def unpack(p):
        rows, pc = p.shape
        out = torch.zeros(rows, pc * 8, dtype=torch.int64)
        v = p.long() & 0xFFFFFFFF
        for c in range(pc):
            for i in range(8):
                out[:, c * 8 + AWQ_ORDER_MAP[i]] = (v[:, c] >> (4 * i)) & 0xF
        return out
    q, z = unpack(qweight), unpack(qzeros)
    g = torch.arange(q.shape[0]) // group_size
    return (q - z[g]).float() * scales.float()[g]


# ---- GPTQ --------------------------------------------------------------------------------------
def gptq_pack_rows(codes: torch.Tensor) -> torch.Tensor:
    k, n = codes.shape
    out = torch.zeros(k // 8, n, dtype=torch.int64)
    for r in range(k // 8):
        for j in range(8):
            out[r] |= codes[r * 8 + j].long() << (4 * j)
    return _as_int32(out)


def gptq_pack_zeros(zeros: torch.Tensor) -> torch.Tensor:
    g, n = zeros.shape
    out = torch.zeros(g, n // 8, dtype=torch.int64)
    for c in range(n // 8):
        for j in range(8):
            out[:, c] |= zeros[:, c * 8 + j].long() << (4 * j)
    return _as_int32(out)


def gptq_quantize(w: torch.Tensor, group_size: int, sym: bool = False, act_order: bool = False, seed: int = 0):
    """w [out, in] fp32 -> ({qweight, qzeros, scales, g_idx}, dequantized [out, in]), format v1."""
    w_io = w.T.contiguous()
    k, n = w_io.shape
    g = k if group_size == -1 else group_size
    order = torch.randperm(k, generator=torch.Generator().manual_seed(seed)) if act_order else torch.arange(k)
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[order] = (torch.arange(k) // g).to(torch.int32)  # groups in GPTQ's (permuted) column order
    permuted = w_io[order]
    if sym:
        grouped = permuted.reshape(k // g, g, n)
        scales = (grouped.abs().amax(1).clamp(min=1e-5) / 7).half().float()
        zeros = torch.full_like(scales, 8).long()
        codes_p = torch.clamp(torch.round(grouped / scales[:, None]) + 8, 0, 15).reshape(k, n).long()
    else:  # zero >= 1: v1 stores zero - 1, which must fit a nibble
        codes_p, zeros, scales = _group_minmax_quant(permuted, g, zero_lo=1)
    codes = torch.empty_like(codes_p)
    codes[order] = codes_p
    deq = (codes.float() - zeros[g_idx.long()].float()) * scales[g_idx.long()]
    tensors = {"qweight": gptq_pack_rows(codes), "qzeros": gptq_pack_zeros(zeros - 1), "scales": scales.half(),
               "g_idx": g_idx}
    return tensors, deq.T.contiguous()


def gptq_reference_dequant(qweight, qzeros, scales, g_idx) -> torch.Tensor:
    """[in, out] fp32 from the v1 layout, bit by bit."""
    kp, n = qweight.shape
    v = qweight.long() & 0xFFFFFFFF
    q = torch.zeros(kp * 8, n, dtype=torch.int64)
    for r in range(kp):
        for j in range(8):
            q[r * 8 + j] = (v[r] >> (4 * j)) & 0xF
    zv = qzeros.long() & 0xFFFFFFFF
    z = torch.zeros(qzeros.shape[0], n, dtype=torch.int64)
    for c in range(n // 8):
        for j in range(8):
            z[:, c * 8 + j] = ((zv[:, c] >> (4 * j)) & 0xF) + 1
    gi = g_idx.long()
    return (q - z[gi]).float() * scales.float()[gi]


# ---- fp8 ---------------------------------------------------------------------------------------
def fp8_block_quantize(w: torch.Tensor, block: int = 128):
    out, inp = w.shape
    blocks = w.reshape(out // block, block, inp // block, block)
    scale = (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12)
    q = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn)
    deq = (q.float() * scale[:, None, :, None]).reshape(out, inp)
    return {"weight": q.reshape(out, inp), "weight_scale_inv": scale}, deq


def fp8_tensor_quantize(w: torch.Tensor):
    scale = (w.abs().amax() / FP8_MAX).clamp(min=1e-12)
    q = (w / scale).to(torch.float8_e4m3fn)
    return {"weight": q, "weight_scale": scale.reshape(())}, q.float() * scale


# ---- checkpoints -------------------------------------------------------------------------------
QUANT_CONFIGS = {
    "awq": lambda g, **_: {"quant_method": "awq", "bits": 4, "group_size": g, "zero_point": True, "version": "gemm",
                           "modules_to_not_convert": None},
    "gptq": lambda g, sym=False, act_order=False, **_: {
        "quant_method": "gptq", "bits": 4, "group_size": g, "desc_act": act_order, "sym": sym,
        "checkpoint_format": "gptq", "lm_head": False, "static_groups": False, "true_sequential": True},
    "fp8_block": lambda *_, **__: {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                   "weight_block_size": [128, 128]},
    "fp8_tensor": lambda *_, **__: {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3"},
}


def _quantizer(fmt: str, group_size: int, **opts):
    if fmt == "awq":
        return lambda w, i: awq_quantize(w, group_size)
    if fmt == "gptq":
        return lambda w, i: gptq_quantize(w, group_size, seed=i, **opts)
    if fmt == "fp8_block":
        return lambda w, i: fp8_block_quantize(w)
    return lambda w, i: fp8_tensor_quantize(w)


def write_quantized_checkpoint(src: str, dst: str, ref: str, fmt: str, group_size: int = 32, **opts) -> None:
    """Quantize the decoder linears of the float checkpoint `src` into `dst` (format `fmt`, its
    config.json carrying quantization_config) and write the same model with those weights
    dequantized to fp32 into `ref` (the fidelity reference)."""
    from radixserve.model_loader.sources import safetensors_files
    from safetensors.torch import load_file, save_file

    weights = {}
    for f in safetensors_files(src):
        weights.update(load_file(f))
    quantized, dequantized = {}, {}
    quantize = _quantizer(fmt, group_size, **opts)
    for name, t in sorted(weights.items()):
        parts = name.split(".")
        if len(parts) >= 2 and parts[-1] == "weight" and parts[-2] in DECODER_LINEARS:
            # projections that read the same input (q/k/v, gate/up) share GPTQ's act-order, as in
            # a real checkpoint: seed by layer and input
            shared = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gu", "up_proj": "gu"}
            key = ".".join(parts[:-2] + [shared.get(parts[-2], parts[-2])])
            tensors, deq = quantize(t.float(), sum(map(ord, key)))
            prefix = name[: -len("weight")]
            quantized.update({prefix + k: v.contiguous() for k, v in tensors.items()})
            dequantized[name] = deq.contiguous()
        else:
            quantized[name] = dequantized[name] = t.contiguous()
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    for out, tensors, cfg in ((dst, quantized, {**config, "quantization_config": QUANT_CONFIGS[fmt](group_size, **opts)}),
                              (ref, dequantized, config)):
        os.makedirs(out, exist_ok=True)
        save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(out, "config.json"), "w") as f:
            json.dump(cfg, f, indent=2)
