"""The default QuantMethod: a plain floating-point weight."""

from __future__ import annotations

import torch
import torch.nn as nn

from radixserve.interfaces.quantization import QuantMethod
from radixserve.layers import cpu_gemm, triton_gemv
from radixserve.layers.weight_utils import default_weight_loader, set_weight_attrs


class UnquantizedMethod(QuantMethod):
    """The default method (registered as "unquantized"): a plain floating-point weight, and the
    reference a plugin method can copy or subclass.

    - `create_weights`: one `weight` `[sum(output_sizes), input_size]` in the activation dtype, with
      `input_dim=1`, `output_dim=0` and the layer's own `weight_loader` (it knows the TP shard and
      the fused layout).
    - `process_weights_after_loading`: keeps a packed copy for the CPU's native GEMM as
      `layer.packed_weight` (`cpu_gemm.pack`; `pack_silu_gated` for a bias-free `[gate; up]`
      projection marked `fuse_silu_and_mul`); None off the CPU or for a non-fp32 weight.
    - `apply`: the runner's batch-1 GEMV where it attached a tile (`layer.gemv_config`), else
      `cpu_gemm.linear(x, layer.weight, layer.packed_weight, bias)` (the native panel GEMM for fp32
      CPU rows, `F.linear` otherwise). A plugin that dequantizes once can end in the same state
      (`weight` + `packed_weight`) and call it (docs/quantization.md, "A fast CPU path").
    - MoE: `w13_weight [E, 2I, H]` (gate rows, then up rows; `moe_fused_dim=1`) and `w2_weight
      [E, H, I]`; experts packed for the CPU after loading; `apply_moe` runs the Triton fused-MoE
      kernel on CUDA, one GEMM pair per expert on the CPU.

    `supports_tensor_parallel` is True: the layers shard the plain weight."""

    supports_tensor_parallel = True  # the layers shard the plain weight (GGUF, dequantized, too)

    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int], dtype: torch.dtype) -> None:
        weight = nn.Parameter(torch.empty(sum(output_sizes), input_size, dtype=dtype), requires_grad=False)
        # the layer knows its TP shard and fused layout, so it owns the loader when it has one
        loader = getattr(layer, "weight_loader", default_weight_loader)
        set_weight_attrs(weight, {"input_dim": 1, "output_dim": 0, "weight_loader": loader})
        layer.register_parameter("weight", weight)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        # None off CPU fp32; a [gate; up] projection that feeds SiluAndMul gets the fused packing
        if getattr(layer, "fuse_silu_and_mul", False) and getattr(layer, "bias", None) is None:
            layer.packed_weight = cpu_gemm.pack_silu_gated(layer.weight)
        else:
            layer.packed_weight = cpu_gemm.pack(layer.weight)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        # a tile set by the runner (runtime.batch1_gemv, layers/gemv_selection.py): one row -> the GEMV
        gemv_config = getattr(layer, "gemv_config", None)
        if gemv_config is not None and x.dim() == 2 and x.shape[0] == 1:
            return triton_gemv.gemv(x, layer.weight, bias, gemv_config)
        return cpu_gemm.linear(x, layer.weight, getattr(layer, "packed_weight", None), bias)

    # MoE experts (plugin API 1.3): stacked [E, 2I, H] and [E, H, I] weights
    def create_moe_weights(self, layer: nn.Module, num_experts: int, hidden_size: int, intermediate_size: int,
                           dtype: torch.dtype) -> None:
        w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size, dtype=dtype),
                           requires_grad=False)
        w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size, dtype=dtype), requires_grad=False)
        set_weight_attrs(w13, {"weight_loader": layer.weight_loader, "moe_fused_dim": 1})
        set_weight_attrs(w2, {"weight_loader": layer.weight_loader})
        layer.register_parameter("w13_weight", w13)
        layer.register_parameter("w2_weight", w2)

    def process_moe_weights_after_loading(self, layer: nn.Module) -> None:
        from radixserve.layers.moe.cpu import pack_experts

        layer.packed_experts = pack_experts(layer.w13_weight, layer.w2_weight)  # None off CPU fp32

    def apply_moe(self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor) -> torch.Tensor:
        from radixserve.layers.moe import cpu, triton_kernel

        if triton_kernel.available(x):
            return triton_kernel.triton_fused_experts(x, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids)
        return cpu.cpu_fused_experts(x, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids,
                                     getattr(layer, "packed_experts", None))
