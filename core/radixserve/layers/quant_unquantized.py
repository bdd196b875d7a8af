"""The default QuantMethod: a plain floating-point weight."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from radixserve.interfaces.quantization import QuantMethod


class UnquantizedMethod(QuantMethod):
    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int], dtype: torch.dtype) -> None:
        weight = nn.Parameter(torch.empty(sum(output_sizes), input_size, dtype=dtype), requires_grad=False)
        layer.register_parameter("weight", weight)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, layer.weight, bias)
