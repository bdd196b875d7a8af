"""QuantMethod: how linear layers store and apply their weights; WeightSource: the role of a
quantization component that also reads a checkpoint file format (GGUF)."""

from __future__ import annotations

import abc
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    import torch.nn as nn


class QuantMethod(abc.ABC):
    """Registered (kind "quantization") under the HF `quantization_config.quant_method` it
    implements (e.g. "fp8"). The default, "unquantized", keeps a plain `weight` parameter.

    How the core picks the method for a model (before any weight is read):
    - a checkpoint *file* (e.g. `model.gguf`) is read by the quantization component that declared
      the weight-source role for its suffix (see `WeightSource`); that component is also the
      layers' QuantMethod. `stack.quantization`, if set, must name that same component.
    - an HF directory uses `stack.quantization` if set, else its `quantization_config.quant_method`,
      else "unquantized". A method that conflicts with the checkpoint's declared `quant_method`,
      or a weight source (which reads files, not directories), is a start-up error naming both.

    Contract:
    - `create_weights(layer, input_size, output_sizes, dtype)` registers the layer's parameters
      (e.g. `weight`, scales) on `layer` and attaches a `weight_loader` to each; `output_sizes`
      lists the fused sub-matrices' rows (one entry for a plain linear, [q, k, v] for qkv).
    - `process_weights_after_loading(layer)` runs once after all weights are loaded (repacking,
      transposing, computing scales). It must be idempotent in effect and must not allocate
      per-forward state.
    - `apply(layer, x, bias)` computes `x @ W.T + bias` in x's dtype.

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


class WeightSource(abc.ABC):
    """The weight-source role: a QuantMethod that reads a checkpoint *file format*.

    Declare it at registration, so the core finds the component by file type without importing it:
    `registry.register("quantization", "gguf", "pkg.mod:Cls", weight_file_suffixes=(".gguf",))`,
    where `Cls` subclasses both `QuantMethod` and `WeightSource`. When `model.path` is a file
    ending in a declared suffix, the core instantiates that component (no arguments) and calls:

    - `hf_config(path)` -> a `transformers.PretrainedConfig` (architectures, sizes, vocab, rope...);
      the model class is picked from its `architectures[0]`.
    - `num_tensors(path)` -> the number of tensors `iter_weights` yields (for progress), or None.
    - `iter_weights(path, hf_config)` -> `(name, tensor)` pairs with Hugging Face parameter names
      (`model.layers.0.self_attn.q_proj.weight`, ...), fed to the model's `load_weights`.
    - then it is the layers' QuantMethod (a dequantize-at-load source keeps them unquantized).

    The core never calls a weight source by its name; two installed components declaring the same
    suffix resolve like any other conflict (the first by priority, then name).

    Added in plugin API 1.0.
    """

    @abc.abstractmethod
    def hf_config(self, path: str) -> Any: ...

    def num_tensors(self, path: str) -> int | None:
        return None

    @abc.abstractmethod
    def iter_weights(self, path: str, hf_config: Any) -> Iterator[tuple[str, torch.Tensor]]: ...
