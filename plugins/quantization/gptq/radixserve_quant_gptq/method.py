"""GPTQ (`quant_method: gptq`, the AutoGPTQ / GPTQModel layout) as a RadixServe QuantMethod.

Checkpoint layout of one linear y = x @ W (W [K in, N out], G groups):
- `qweight` int32 [K/8, N]: 4-bit codes packed along the *input* dim, row k in bits 4*(k % 8);
- `qzeros` int32 [G, N/8]: zero points packed along the output dim, column n in bits 4*(n % 8).
  `checkpoint_format: gptq` (v1, AutoGPTQ and most published checkpoints) stores zero - 1 and
  readers add 1 back; `gptq_v2` (GPTQModel) stores the zero itself. Symmetric checkpoints
  (`sym: true`) have every zero at 8.
- `scales` fp16 [G, N];
- `g_idx` int32 [K]: the group of each input row: k // group_size, or, with act-order
  (`desc_act: true`), the group in the order GPTQ quantized the columns.
W[k, n] = (code[k, n] - zero[g_idx[k], n]) * scale[g_idx[k], n]. `group_size: -1` is one group.

`qweight` is already the shared int4 kernel layout (`radixserve.layers.quant_int4`); act-order
checkpoints get their rows sorted by group (and the inputs permuted to match) after loading.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from radixserve.interfaces.quantization import QuantMethod
from radixserve.layers.linear import RowParallelLinear
from radixserve.layers.quant_int4 import PACK, add_row_layout, int4_linear, make_int4_weight, unpack_int4
from radixserve.layers.weight_utils import set_weight_attrs

SUPPORTED_GROUP_SIZES = (-1, 32, 64, 128)
_CHECKPOINT_PARAMS = ("qweight", "qzeros", "scales", "g_idx")


class GPTQMethod(QuantMethod):
    min_capability = 75  # Triton int4 kernels: Turing and newer

    def __init__(self, group_size: int = 128, desc_act: bool = False, zero_offset: int = 1) -> None:
        if group_size not in SUPPORTED_GROUP_SIZES:
            raise ValueError(f"GPTQ group_size={group_size} is not supported (supported: "
                             f"{', '.join(map(str, SUPPORTED_GROUP_SIZES))})")
        self.group_size = group_size
        self.desc_act = desc_act
        self.zero_offset = zero_offset  # added to stored zeros: 1 for checkpoint_format "gptq" (v1)

    @classmethod
    def from_config(cls, quant_config: dict[str, Any] | None) -> GPTQMethod:
        if quant_config is None:
            raise ValueError("GPTQ needs a GPTQ checkpoint (config.json quantization_config with quant_method "
                             "'gptq'); it cannot quantize a float checkpoint online (use fp8 for that)")
        bits = quant_config.get("bits", 4)
        if bits != 4:
            raise ValueError(f"GPTQ bits={bits} is not supported (only 4)")
        if quant_config.get("lm_head", False):
            raise ValueError("GPTQ lm_head=true (a quantized LM head) is not supported")
        fmt = str(quant_config.get("checkpoint_format", "gptq")).lower()
        if fmt not in ("gptq", "gptq_v2"):
            raise ValueError(f"GPTQ checkpoint_format={fmt!r} is not supported (gptq, gptq_v2)")
        return cls(int(quant_config.get("group_size", 128)), bool(quant_config.get("desc_act", False)),
                   1 if fmt == "gptq" else 0)

    def _groups(self, input_size: int) -> int:
        if self.group_size == -1:
            return 1
        if input_size % self.group_size:
            raise ValueError(f"GPTQ layer with {input_size} input features: not a multiple of "
                             f"group_size={self.group_size}")
        return input_size // self.group_size

    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int], dtype: torch.dtype) -> None:
        out = sum(output_sizes)
        if input_size % PACK or any(n % PACK for n in output_sizes):
            raise ValueError(f"GPTQ layer [{input_size} -> {output_sizes}]: features must be multiples of {PACK}")
        loader = layer.weight_loader
        # with act-order a row-parallel rank's rows may use any group, and one group spans all
        # rows: the group tensors are then whole on every rank (no input_dim)
        group_split = {} if (self.desc_act or self.group_size == -1) else {"input_dim": 0}
        full_input = input_size * layer.tp_size if isinstance(layer, RowParallelLinear) else input_size
        groups = self._groups(full_input if self.desc_act else input_size)
        for name, shape, dt, attrs in (
            ("qweight", (input_size // PACK, out), torch.int32,
             {"input_dim": 0, "output_dim": 1, "packed_dim": 0, "pack_factor": PACK}),
            ("qzeros", (groups, out // PACK), torch.int32,
             {"output_dim": 1, "packed_dim": 1, "pack_factor": PACK, **group_split}),
            ("scales", (groups, out), _scale_dtype(dtype), {"output_dim": 1, **group_split}),
        ):
            p = nn.Parameter(torch.empty(shape, dtype=dt), requires_grad=False)
            set_weight_attrs(p, {**attrs, "weight_loader": loader})
            layer.register_parameter(name, p)
        g_idx = nn.Parameter(torch.empty(input_size, dtype=torch.int32), requires_grad=False)
        set_weight_attrs(g_idx, {"input_dim": 0, "weight_loader": _g_idx_loader(layer)})
        layer.register_parameter("g_idx", g_idx)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if getattr(layer, "int4_weight", None) is not None:
            return
        zeros = unpack_int4(layer.qzeros.data, 1).to(torch.float32) + self.zero_offset
        g_idx = layer.g_idx.data
        groups = layer.scales.shape[0]
        if self.desc_act and (int(g_idx.min()) < 0 or int(g_idx.max()) >= groups):
            raise ValueError(f"GPTQ g_idx holds groups {int(g_idx.min())}..{int(g_idx.max())}, but the layer has "
                             f"{groups} (a corrupt checkpoint, or desc_act/group_size not matching it)")
        if not self.desc_act:  # groups in row order; local to this rank when the groups are split
            rows = torch.arange(g_idx.numel(), device=g_idx.device, dtype=torch.int32)
            g_idx = rows // self.group_size if self.group_size > 0 else torch.zeros_like(rows)
        layer.int4_weight = make_int4_weight(layer.qweight.data, layer.scales.data, zeros, g_idx,
                                             layer.scales.dtype, packed=True)
        for name in _CHECKPOINT_PARAMS:
            delattr(layer, name)

    def enable_lowbit_gemv(self, layer: nn.Module) -> bool:
        return add_row_layout(layer.int4_weight)  # batches of <= 4 rows: the whole-row int4 GEMV

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return int4_linear(x, layer.int4_weight, bias)


def _g_idx_loader(layer: nn.Module):
    """g_idx follows the input features: a row-parallel rank takes its slice; the shards of a
    fused column layer (q/k/v, gate/up) share their input, so they must carry the same g_idx."""

    def load(param: torch.Tensor, loaded: torch.Tensor, shard_id: Any = None) -> None:
        if isinstance(layer, RowParallelLinear):
            layer.weight_loader(param, loaded)
            return
        if tuple(loaded.shape) != tuple(param.shape):
            raise ValueError(f"g_idx: expected shape {tuple(param.shape)}, got {tuple(loaded.shape)}")
        loaded = loaded.to(param.device, param.dtype)  # the checkpoint's tensor is on the CPU, the layer may not be
        if getattr(param, "loaded_once", False) and not torch.equal(param.data, loaded):
            raise ValueError(f"g_idx of fused shard {shard_id!r} differs from the other shards' (act-order "
                             "permutations must match across q/k/v and gate/up)")
        param.data.copy_(loaded)
        param.loaded_once = True

    return load


def _scale_dtype(act_dtype: torch.dtype) -> torch.dtype:
    """Checkpoints store fp16 scales: keep them exact (bf16 would drop 3 mantissa bits); fp32 runs
    keep fp32."""
    return torch.float16 if act_dtype in (torch.float16, torch.bfloat16) else act_dtype
