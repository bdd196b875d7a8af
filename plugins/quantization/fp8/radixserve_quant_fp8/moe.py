"""Block-FP8 routed experts (DeepSeek-V3 style checkpoints): the experts stay FP8 in memory, one
128x128 scale per tile, and are dequantized only when a batch uses them.

Parameters on the FusedMoE layer (loaded through its `weight_loader`, per expert or whole):
`w13_weight` fp8 [E, 2I, H] (gate rows, then up rows), `w13_weight_scale_inv` fp32
[E, 2I/128, H/128], `w2_weight` fp8 [E, H, I], `w2_weight_scale_inv` fp32 [E, H/128, I/128].

Compute (correct everywhere, graph-safe: no shape depends on the routing): a batch with fewer
(token, expert) pairs than experts dequantizes just those pairs' weights and runs them as batched
matmuls (decode); a larger batch dequantizes every expert once and runs the core's fused-expert
path on the float stacks (prefill). Not a fused FP8 kernel: the memory of the FP8 experts is kept,
the bandwidth win of reading 1 byte per weight is not (yet).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from radixserve.layers.weight_utils import set_weight_attrs

from radixserve_quant_fp8.kernels import dequantize_blocks

FP8 = torch.float8_e4m3fn


def create_block_fp8_moe_weights(layer: nn.Module, num_experts: int, hidden_size: int, intermediate_size: int,
                                 block: tuple[int, int]) -> None:
    bo, bi = block
    where = getattr(layer, "prefix", "") or type(layer).__name__
    if hidden_size % bi or hidden_size % bo or intermediate_size % bi or intermediate_size % bo:
        raise ValueError(f"fp8 experts of {where!r}: hidden size {hidden_size} and expert intermediate size "
                         f"{intermediate_size} must be multiples of the {bo}x{bi} block")
    shapes = {
        "w13_weight": ((num_experts, 2 * intermediate_size, hidden_size), FP8),
        "w13_weight_scale_inv": ((num_experts, 2 * intermediate_size // bo, hidden_size // bi), torch.float32),
        "w2_weight": ((num_experts, hidden_size, intermediate_size), FP8),
        "w2_weight_scale_inv": ((num_experts, hidden_size // bo, intermediate_size // bi), torch.float32),
    }
    for name, (shape, dtype) in shapes.items():
        param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
        attrs = {"weight_loader": layer.weight_loader}
        if name.startswith("w13"):
            attrs["moe_fused_dim"] = 1  # gate rows then up rows (scales: gate tiles then up tiles)
        set_weight_attrs(param, attrs)
        layer.register_parameter(name, param)


def apply_block_fp8_moe(layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                        block: tuple[int, int]) -> torch.Tensor:
    num_experts = layer.w13_weight.shape[0]
    tokens, top_k = topk_ids.shape
    dtype = x.dtype if x.is_cuda else torch.float32  # the CPU multiplies in fp32, as the core's expert path
    if tokens * top_k < num_experts:
        pairs = topk_ids.reshape(-1)
        w13 = dequantize_blocks(layer.w13_weight[pairs], layer.w13_weight_scale_inv[pairs], block, dtype)
        w2 = dequantize_blocks(layer.w2_weight[pairs], layer.w2_weight_scale_inv[pairs], block, dtype)
        xs = x.to(dtype).repeat_interleave(top_k, dim=0).unsqueeze(-1)  # [pairs, H, 1]
        gate, up = torch.bmm(w13, xs).squeeze(-1).chunk(2, dim=-1)
        out = torch.bmm(w2, (F.silu(gate) * up).unsqueeze(-1)).squeeze(-1)  # [pairs, H]
        out = out.view(tokens, top_k, -1) * topk_weights.to(out.dtype).unsqueeze(-1)
        return out.sum(dim=1).to(x.dtype)
    from radixserve.layers.moe import cpu, triton_kernel

    w13 = dequantize_blocks(layer.w13_weight, layer.w13_weight_scale_inv, block, x.dtype)
    w2 = dequantize_blocks(layer.w2_weight, layer.w2_weight_scale_inv, block, x.dtype)
    if triton_kernel.available(x):
        return triton_kernel.triton_fused_experts(x, w13, w2, topk_weights, topk_ids)
    return cpu.cpu_fused_experts(x, w13, w2, topk_weights, topk_ids, None)
