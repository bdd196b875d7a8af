"""AWQ (`quant_method: awq`, AutoAWQ's "gemm" layout) as a RadixServe QuantMethod.

Checkpoint layout of one linear y = x @ W (W [K in, N out], group size g), as AutoAWQ writes it:
- `qweight` int32 [K, N/8]: 4-bit codes packed along the *output* dim in AWQ's interleaved
  order: the eight codes of columns 8c..8c+7 sit in bits 4*i of element c for column
  8c + AWQ_ORDER[i];
- `qzeros` int32 [K/g, N/8]: the zero points, packed the same way;
- `scales` fp16 [K/g, N].
W[k, n] = (code[k, n] - zero[k // g, n]) * scale[k // g, n].

After loading, the codes are repacked along the input dim into the shared int4 kernel layout
(`radixserve.layers.quant_int4`), whose Triton kernel reads the 4-bit weight once per GEMM.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from radixserve.interfaces.quantization import QuantMethod
from radixserve.layers.quant_int4 import PACK, add_row_layout, int4_linear, make_int4_weight, unpack_int4
from radixserve.layers.weight_utils import set_weight_attrs

# column 8c + AWQ_ORDER[i] is stored in nibble i of element c (AutoAWQ's packer)
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
SUPPORTED_GROUP_SIZES = (32, 64, 128)
_CHECKPOINT_PARAMS = ("qweight", "qzeros", "scales")


class AWQMethod(QuantMethod):
    min_capability = 75  # Triton int4 kernels: Turing and newer

    def __init__(self, group_size: int = 128) -> None:
        if group_size not in SUPPORTED_GROUP_SIZES:
            raise ValueError(f"AWQ group_size={group_size} is not supported (supported: "
                             f"{', '.join(map(str, SUPPORTED_GROUP_SIZES))})")
        self.group_size = group_size

    @classmethod
    def from_config(cls, quant_config: dict[str, Any] | None) -> AWQMethod:
        if quant_config is None:
            raise ValueError("AWQ needs an AWQ checkpoint (config.json quantization_config with quant_method "
                             "'awq'); it cannot quantize a float checkpoint online (use fp8 for that)")
        bits = quant_config.get("bits", quant_config.get("w_bit", 4))
        if bits != 4:
            raise ValueError(f"AWQ bits={bits} is not supported (only 4)")
        version = str(quant_config.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"AWQ version={version!r} is not supported (only the 'gemm' layout)")
        if not quant_config.get("zero_point", True):
            raise ValueError("AWQ zero_point=false is not supported (only zero-point checkpoints)")
        skipped = quant_config.get("modules_to_not_convert") or []
        if skipped:
            raise ValueError(f"AWQ modules_to_not_convert={skipped} is not supported (every decoder linear must "
                             "be quantized)")
        return cls(int(quant_config.get("group_size", quant_config.get("q_group_size", 128))))

    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int], dtype: torch.dtype) -> None:
        out = sum(output_sizes)
        if input_size % self.group_size or any(n % PACK for n in output_sizes):
            raise ValueError(f"AWQ layer [{input_size} -> {output_sizes}]: input features must be a multiple of "
                             f"group_size={self.group_size} and each output a multiple of {PACK}")
        groups = input_size // self.group_size
        loader = layer.weight_loader
        packed = {"output_dim": 1, "input_dim": 0, "packed_dim": 1, "pack_factor": PACK, "weight_loader": loader}
        for name, shape, dt, attrs in (
            ("qweight", (input_size, out // PACK), torch.int32, packed),
            ("qzeros", (groups, out // PACK), torch.int32, packed),
            ("scales", (groups, out), _scale_dtype(dtype), {"output_dim": 1, "input_dim": 0, "weight_loader": loader}),
        ):
            p = nn.Parameter(torch.empty(shape, dtype=dt), requires_grad=False)
            set_weight_attrs(p, dict(attrs))
            layer.register_parameter(name, p)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if getattr(layer, "int4_weight", None) is not None:
            return  # already repacked
        codes = unpack_int4(layer.qweight.data, 1, AWQ_ORDER)  # [K, N]
        zeros = unpack_int4(layer.qzeros.data, 1, AWQ_ORDER)  # [G, N]
        k = codes.shape[0]
        g_idx = torch.arange(k, device=codes.device, dtype=torch.int32) // self.group_size
        layer.int4_weight = make_int4_weight(codes, layer.scales.data, zeros.to(torch.float32), g_idx,
                                             layer.scales.dtype, packed=False)
        for name in _CHECKPOINT_PARAMS:  # the kernel layout replaces them: free the checkpoint copy
            delattr(layer, name)

    def enable_lowbit_gemv(self, layer: nn.Module) -> bool:
        return add_row_layout(layer.int4_weight)  # batches of <= 4 rows: the whole-row int4 GEMV

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return int4_linear(x, layer.int4_weight, bias)


def _scale_dtype(act_dtype: torch.dtype) -> torch.dtype:
    """Checkpoints store fp16 scales: keep them exact (bf16 would drop 3 mantissa bits); fp32 runs
    keep fp32."""
    return torch.float16 if act_dtype in (torch.float16, torch.bfloat16) else act_dtype
