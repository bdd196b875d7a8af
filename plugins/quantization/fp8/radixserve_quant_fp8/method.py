"""FP8 (e4m3) linears (and block-FP8 routed experts, see moe.py) as a RadixServe QuantMethod, three ways in:

- HF fp8 checkpoint, block-wise (`quant_method: fp8`, `weight_block_size: [128, 128]`, as
  DeepSeek-V3 / Qwen3-FP8): `weight` float8_e4m3fn [out, in] and `weight_scale_inv` fp32
  [ceil(out/128), ceil(in/128)]; W = weight * scale of its 128x128 block.
- HF fp8 checkpoint, per-tensor (`quant_method: fp8` without `weight_block_size`): `weight` fp8
  and a scalar `weight_scale` per checkpoint tensor (so q, k, v of a fused layer keep their own);
  `input_scale` (activation_scheme "static") is read and not used: activations are always
  quantized per token, dynamically.
- online (`stack.quantization: fp8` on a float checkpoint): the float `weight` is loaded, then
  quantized per output channel (scale = amax / 448) after loading.

Compute: on CUDA, per-channel / per-tensor weights run W8A8 through `torch._scaled_mm` (fp8
tensor cores, rowwise scales: activations per token, weights per channel) above
`kernels.TRITON_MAX_ROWS` rows, and a Triton kernel that reads the fp8 weight with bf16
activations (W8A16, no activation quantization) for decode-sized batches; block-wise weights
run a Triton kernel that dequantizes 128x128 tiles in the GEMM (W8A16, reads 1 byte per weight).
On the CPU every path dequantizes the weight and multiplies in float (correct, not fast).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn as nn
from radixserve.interfaces.quantization import QuantMethod
from radixserve.layers.weight_utils import set_weight_attrs

from radixserve_quant_fp8 import kernels, moe

logger = logging.getLogger(__name__)

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
_SHARD_INDEX = {"q": 0, "k": 1, "v": 2}


class FP8Method(QuantMethod):
    min_capability = 80  # Ampere runs the dequantizing paths; _scaled_mm (W8A8) needs 8.9+

    def __init__(self, serialized: bool = False, block_size: tuple[int, int] | None = None,
                 static_input_scale: bool = False) -> None:
        self.serialized = serialized
        self.block_size = block_size
        self.static_input_scale = static_input_scale

    @classmethod
    def from_config(cls, quant_config: dict[str, Any] | None) -> FP8Method:
        if quant_config is None:
            return cls()  # online: quantize a float checkpoint after loading
        fmt = str(quant_config.get("fmt", "e4m3")).lower()
        if fmt != "e4m3":
            raise ValueError(f"fp8 fmt={fmt!r} is not supported (only e4m3)")
        scheme = str(quant_config.get("activation_scheme", "dynamic")).lower()
        if scheme not in ("dynamic", "static"):
            raise ValueError(f"fp8 activation_scheme={scheme!r} is not supported (dynamic, static)")
        skipped = quant_config.get("modules_to_not_convert") or quant_config.get("ignored_layers") or []
        skipped = [m for m in skipped if "lm_head" not in m]  # the LM head is never quantized here
        if skipped:
            raise ValueError(f"fp8 modules_to_not_convert={skipped} is not supported (every decoder linear must "
                             "be quantized)")
        block = quant_config.get("weight_block_size")
        if block is not None:
            block = tuple(int(b) for b in block)
            if block != (128, 128):
                raise ValueError(f"fp8 weight_block_size={list(block)} is not supported (only [128, 128])")
        return cls(serialized=True, block_size=block, static_input_scale=scheme == "static")

    # ---- weights ----------------------------------------------------------------------------
    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int], dtype: torch.dtype) -> None:
        out = sum(output_sizes)
        loader = layer.weight_loader
        weight = nn.Parameter(torch.empty(out, input_size, dtype=FP8 if self.serialized else dtype),
                              requires_grad=False)
        set_weight_attrs(weight, {"input_dim": 1, "output_dim": 0, "weight_loader": loader})
        layer.register_parameter("weight", weight)
        layer.fp8_output_sizes = list(output_sizes)
        if not self.serialized:
            return
        if self.block_size is not None:
            bo, bi = self.block_size
            if input_size % bi or any(n % bo for n in output_sizes):
                raise ValueError(f"fp8 block-wise layer [{input_size} -> {output_sizes}]: features must be multiples "
                                 f"of the {bo}x{bi} block")
            scale = nn.Parameter(torch.empty(out // bo, input_size // bi, dtype=torch.float32), requires_grad=False)
            set_weight_attrs(scale, {"input_dim": 1, "output_dim": 0, "packed_dim": 0, "pack_factor": bo,
                                     "weight_loader": loader})
            layer.register_parameter("weight_scale_inv", scale)
            return
        names = ("weight_scale", "input_scale") if self.static_input_scale else ("weight_scale",)
        for name in names:
            p = nn.Parameter(torch.ones(len(output_sizes), dtype=torch.float32), requires_grad=False)
            set_weight_attrs(p, {"weight_loader": _per_shard_scale_loader})
            layer.register_parameter(name, p)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if getattr(layer, "fp8_prepared", False):
            return
        if self.block_size is None:
            if self.serialized:  # one scale per fused shard -> one per output row
                sizes = torch.tensor(layer.fp8_output_sizes, device=layer.weight.device)
                rows = torch.repeat_interleave(layer.weight_scale.data, sizes)
            else:  # online: per output channel
                w = layer.weight.data.float()
                rows = (w.abs().amax(dim=1) / FP8_MAX).clamp(min=1e-12)
                q = (w / rows[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
                layer.weight = nn.Parameter(q, requires_grad=False)
            layer.weight_scale_rows = rows.to(torch.float32).contiguous()
        layer.fp8_prepared = True

    def enable_lowbit_gemv(self, layer: nn.Module) -> bool:
        """Per-row scaled weights on CUDA: batches of <= 2 rows on the whole-row fp8 GEMV (`apply`)."""
        if self.block_size is not None or not layer.weight.is_cuda:
            return False
        layer.fp8_row_gemv = True
        return True

    # ---- routed experts (FusedMoE), block-FP8 checkpoints only -----------------------------------
    def create_moe_weights(self, layer: nn.Module, num_experts: int, hidden_size: int, intermediate_size: int,
                           dtype: torch.dtype) -> None:
        if not (self.serialized and self.block_size is not None):
            super().create_moe_weights(layer, num_experts, hidden_size, intermediate_size, dtype)  # refuses, naming it
            return
        moe.create_block_fp8_moe_weights(layer, num_experts, hidden_size, intermediate_size, self.block_size)

    def apply_moe(self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor) -> torch.Tensor:
        return moe.apply_block_fp8_moe(layer, x, topk_weights, topk_ids, self.block_size)

    # ---- compute ----------------------------------------------------------------------------
    def dequantized_weight(self, layer: nn.Module, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """W [out, in] in `dtype` (the reference every path must match)."""
        if self.block_size is not None:
            return kernels.dequantize_blocks(layer.weight.data, layer.weight_scale_inv.data, self.block_size, dtype)
        return (layer.weight.data.to(torch.float32) * layer.weight_scale_rows[:, None]).to(dtype)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        y = None
        if x2.is_cuda:
            if self.block_size is not None:
                y = kernels.block_fp8_linear(x2, layer.weight, layer.weight_scale_inv, self.block_size)
            else:
                y = kernels.rowwise_fp8_linear(x2, layer.weight, layer.weight_scale_rows,
                                               row_gemv=getattr(layer, "fp8_row_gemv", False))
        if y is None:  # CPU, or a GPU without fp8 GEMMs: dequantize
            y = (x2.float() @ self.dequantized_weight(layer).T).to(x.dtype)
        if bias is not None:
            y = y + bias.to(y.dtype)
        return y.reshape(*shape[:-1], y.shape[-1])


def _per_shard_scale_loader(param: torch.Tensor, loaded: torch.Tensor, shard_id: Any = None) -> None:
    """A scalar scale per checkpoint tensor: shard `q`/`k`/`v` or 0/1 goes to its slot; a whole
    (unfused) tensor's scale fills every slot."""
    value = loaded.reshape(-1).to(torch.float32)
    if value.numel() != 1:
        raise ValueError(f"expected a per-tensor (scalar) fp8 scale, got shape {tuple(loaded.shape)}")
    if shard_id is None:
        param.data.fill_(value.item())
    else:
        idx = _SHARD_INDEX[shard_id] if isinstance(shard_id, str) else int(shard_id)
        param.data[idx] = value[0]
