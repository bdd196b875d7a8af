"""QuantMethod: how linear layers store and apply their weights."""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    import torch.nn as nn


class QuantMethod(abc.ABC):
    """Registered under the HF `quantization_config.quant_method` (e.g. "fp8") or a file format
    ("gguf"). The default, "unquantized", keeps a plain `weight` parameter.

    Contract:
    - `create_weights(layer, input_size, output_sizes, dtype)` registers the layer's parameters
      (e.g. `weight`, scales) on `layer` and attaches a `weight_loader` to each; `output_sizes`
      lists the fused sub-matrices' rows (one entry for a plain linear, [q, k, v] for qkv).
    - `process_weights_after_loading(layer)` runs once after all weights are loaded (repacking,
      transposing, computing scales). It must be idempotent in effect and must not allocate
      per-forward state.
    - `apply(layer, x, bias)` computes `x @ W.T + bias` in x's dtype.
    - A method that only changes how files are *read* (GGUF dequantize-at-load) can instead be a
      weight-source: `iter_weights(path)` yielding HF-named tensors, and leave layers unquantized.

    Added in plugin API 1.0.
    """

    @abc.abstractmethod
    def create_weights(
        self, layer: nn.Module, input_size: int, output_sizes: list[int], dtype: torch.dtype
    ) -> None: ...

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        return None

    @abc.abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor: ...
