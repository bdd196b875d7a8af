"""QuantMethod: how linear layers (and MoE experts) store and apply their weights; WeightSource: the role of a
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
    implements (e.g. "awq", "gptq", "fp8"). The default, "unquantized", keeps a plain `weight`.

    How the core picks the method for a model (before any weight is read):
    - a checkpoint *file* (e.g. `model.gguf`) is read by the quantization component that declared
      the weight-source role for its suffix (see `WeightSource`); that component is also the
      layers' QuantMethod. `stack.quantization`, if set, must name that same component.
    - an HF directory uses `stack.quantization` if set, else its `quantization_config.quant_method`,
      else "unquantized". A method that conflicts with the checkpoint's declared `quant_method`,
      or a weight source (which reads files, not directories), is a start-up error naming both.
    - the instance is built with `from_config(quantization_config)` (the checkpoint's dict, or None
      when the checkpoint declares none, e.g. online quantization of a bf16 checkpoint), then
      `check_device(device, dtype)` runs; both raise ValueError naming the bad value and what
      works. The registration's `devices=` is checked first (a clear error naming those devices).

    Which layers: the model passes the method to its decoder linear layers only (attention
    projections, MLP); embeddings and the LM head always stay unquantized. A format whose
    checkpoint quantizes those (GPTQ `lm_head: true`) or skips some linears
    (`modules_to_not_convert`) must refuse it in `from_config`.

    Contract, per linear layer:
    - `create_weights(layer, input_size, output_sizes, dtype)` registers the layer's parameters
      (e.g. `weight`, or `qweight`/`qzeros`/`scales`/`g_idx`) on `layer`, named as the checkpoint
      names them, and attaches a `weight_loader` to each; `output_sizes` lists the fused
      sub-matrices' local rows (one entry for a plain linear, [q, k, v] for qkv). `input_size` is
      local too (divided by tp_size for a row-parallel layer). `dtype` is the activation dtype.
      Parameter attributes the layers' own loaders read (set with `set_weight_attrs`):
        - `output_dim`: the dim indexing output features (split across column-parallel ranks,
          where fused shards are placed);
        - `input_dim`: the dim indexing input features (split across row-parallel ranks); a
          parameter without it is replicated on every row-parallel rank;
        - `packed_dim` + `pack_factor`: that dim holds `pack_factor` features per element (int4
          packed in int32: 8; a 128x128 block scale: 128), so the layers divide shard offsets
          and sizes along it by `pack_factor` (sizes must divide evenly).
    - `process_weights_after_loading(layer)` runs once after all weights are loaded (repacking
      for the kernel, transposing, computing scales). It must be idempotent in effect and must
      not allocate per-forward state.
    - `apply(layer, x, bias)` computes `x @ W.T + bias` in x's dtype (W the dequantized weight;
      x is [n, input_size], n from 1 to the prefill chunk).

    Class attributes: `min_capability` (CUDA compute capability as 10*major+minor, e.g. 80, or
    None for any), checked by the default `check_device`.

    Contract, per MoE layer (`radixserve.layers.moe.FusedMoE`; added in plugin API 1.3):
    - `create_moe_weights(layer, num_experts, hidden_size, intermediate_size, dtype)` registers the
      stacked expert parameters on `layer` (unquantized: `w13_weight` [E, 2I, H], gate rows then
      up rows, and `w2_weight` [E, H, I]), each with `weight_loader=layer.weight_loader` (it takes
      `shard_id` "gate"/"up"/"down" and `expert_id`) and, on a parameter holding gate and up
      stacked, `moe_fused_dim` (the dim along which the two halves sit). The default refuses: a
      method without MoE support raises ValueError naming the method and the layer, at start-up.
    - `process_moe_weights_after_loading(layer)` runs once after loading (default: nothing).
    - `apply_moe(layer, x, topk_weights, topk_ids)` returns the routed experts' output [T, H] in
      x's dtype: sum over k of topk_weights[t, k] * down_e(silu(gate_e(x_t)) * up_e(x_t)) with
      e = topk_ids[t, k] (topk_weights fp32 [T, K], topk_ids int32 [T, K]).

    Optional, per linear layer: `enable_lowbit_gemv(layer)` (below), for methods with weights the
    core's small-batch low-bit GEMVs read.

    Added in plugin API 1.0; `from_config`, `check_device`, `min_capability` and the packed
    parameter attributes in 1.1; the MoE hooks in 1.3; `enable_lowbit_gemv` in 1.7.
    """

    supports_tensor_parallel: bool = False
    """Class flag: this component works when `runtime.tp_size > 1` (`create_weights` gets the
    layer's per-rank sizes and the weights' loader must shard through the layer's
    `weight_loader`; packed or grouped layouts must split along the rank boundaries). The stack
    resolution refuses a tp_size > 1 config that selects a component leaving it False, naming it.
    Added in plugin API 1.3."""

    min_capability: int | None = None

    @classmethod
    def from_config(cls, quant_config: dict[str, Any] | None) -> QuantMethod:
        """Build the method for a checkpoint's `quantization_config` (None: the checkpoint declares
        none). Raise ValueError naming any setting this method does not support."""
        return cls()

    def check_device(self, device: torch.device, dtype: torch.dtype) -> None:
        """Raise ValueError when this method cannot run on `device` with activations in `dtype`
        (say which devices/dtypes work). Default: the CUDA capability check."""
        if device.type != "cuda" or self.min_capability is None:
            return
        import torch

        major, minor = torch.cuda.get_device_capability(device)
        if major * 10 + minor < self.min_capability:
            need = f"{self.min_capability // 10}.{self.min_capability % 10}"
            raise ValueError(f"quantization method {type(self).__name__} needs a CUDA device of compute capability "
                             f">= {need}; this one is {major}.{minor} (use the CPU or a newer GPU)")

    @abc.abstractmethod
    def create_weights(
        self, layer: nn.Module, input_size: int, output_sizes: list[int], dtype: torch.dtype
    ) -> None:
        """Register the layer's parameters for a [sum(output_sizes), input_size] linear (this rank's shard),
        each with its weight loader and `input_dim` / `output_dim` (the class docstring and contracts.md,
        "Quantization methods", say what the loader does with them)."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Repack the loaded parameters for `apply` (transpose, pack, quantize online). It may be called
        again on a layer already processed: it must then leave the layer as it is. Default: nothing."""
        return None

    def enable_lowbit_gemv(self, layer: nn.Module) -> bool:
        """Prepare `layer` so that `apply` runs batches of a few rows on the core's whole-row low-bit
        GEMVs (`radixserve.layers.lowbit_gemv`: `int4_gemv` over a `repack_int4` copy, `fp8_gemv` over
        an fp8 weight with per-row scales). The loader calls it once per linear layer, after
        `process_weights_after_loading`, only for a model whose `runtime.lowbit_gemv` resolves on (the
        default on CUDA). Return True when the layer will use them, False when it will not (then it must
        be left as it was). Must not change `apply`'s result beyond the kernels' rounding. Default:
        False. Added in plugin API 1.7 (replacing a process-wide switch)."""
        return False

    @abc.abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """The layer's output `x @ W^T (+ bias)` for `x` [tokens, input_size] in the runtime dtype, within
        the method's own rounding of the dequantized reference (what `check_quant_method` compares)."""

    def create_moe_weights(self, layer: nn.Module, num_experts: int, hidden_size: int, intermediate_size: int,
                           dtype: torch.dtype) -> None:
        """Register an MoE layer's stacked expert parameters. Default: refuse (ValueError naming
        this method and the layer). Added in plugin API 1.3."""
        where = getattr(layer, "prefix", "") or type(layer).__name__
        raise ValueError(f"quantization method {type(self).__name__} does not support MoE expert weights "
                         f"(layer {where!r}, {num_experts} experts); serve this model unquantized or with a "
                         "method that supports MoE")

    def process_moe_weights_after_loading(self, layer: nn.Module) -> None:
        """Prepare loaded expert weights for `apply_moe` (once). Added in plugin API 1.3."""
        return None

    def apply_moe(self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor) -> torch.Tensor:
        """The routed experts' output [T, H] (see the class docstring). Added in plugin API 1.3."""
        raise NotImplementedError(f"quantization method {type(self).__name__} does not implement apply_moe")


class WeightSource(abc.ABC):
    """The weight-source role: a QuantMethod that reads a checkpoint *file format*.

    Declare it at registration, so the core finds the component by file type without importing it:
    `registry.register("quantization", "gguf", "pkg.mod:Cls", weight_file_suffixes=(".gguf",))`,
    where `Cls` subclasses both `QuantMethod` and `WeightSource`. When `model.path` is a file
    ending in a declared suffix, the core instantiates that component (no arguments) and calls:

    - `hf_config(path)` -> a `transformers.PretrainedConfig` (architectures, sizes, vocab, rope...);
      the model class is picked from its `architectures[0]`. Or a plain object with the same
      attributes and a `to_transformers()` method returning the PretrainedConfig (for model code
      that needs the real class): keeps transformers out of the serving process (GGUF does this).
    - `num_tensors(path)` -> the number of tensors `iter_weights` yields (for progress), or None.
    - `iter_weights(path, hf_config)` -> `(name, tensor)` pairs with Hugging Face parameter names
      (`model.layers.0.self_attn.q_proj.weight`, ...), fed to the model's `load_weights`.
    - then it is the layers' QuantMethod (a dequantize-at-load source keeps them unquantized).
    - optionally `file_tensor_name(name)`: the file's own name of a tensor, for error messages
      (plugin API 1.18).

    - optionally `prepare_model(model)`, called once after the model is built and before any
      weight is read: a source that keeps embeddings or the LM head in the file's format swaps
      those modules here (returning the model, or None for the same one). Added in plugin API 1.4.

    Options: `model.weight_source_options` are passed to the constructor as keyword arguments
    (unknown names are a start-up error listing the constructor's). Added in plugin API 1.4.

    The tokenizer is not the weight source's: the core reads it from `model.tokenizer` (serve
    or generate `--tokenizer`), a directory with `tokenizer.json` / `tokenizer_config.json`; only `.gguf` files
    have one built in. Users of another file format set `model.tokenizer` (without it the start-up
    error says so).

    The core never calls a weight source by its name. Two installed components declaring the same
    suffix are not an error: the first by priority, then name, reads such files (the default model's
    `.gguf` too), and `radixserve plugins` marks the other "not used"; disable a plugin
    (`plugins.disable`, `-p no:PLUGIN`) to switch.

    Added in plugin API 1.0.
    """

    @abc.abstractmethod
    def hf_config(self, path: str) -> Any: ...

    def num_tensors(self, path: str) -> int | None:
        return None

    @abc.abstractmethod
    def iter_weights(self, path: str, hf_config: Any) -> Iterator[tuple[str, torch.Tensor]]: ...

    def file_tensor_name(self, name: str) -> str | None:
        """How the file names the tensor `iter_weights` yields as HF name `name` (for error messages: a
        tensor missing from the file, or one whose shape its parameter cannot take, is named both ways,
        `model.layers.1.mlp.down_proj.weight (blk.1.ffn_down.weight in the file)`); None (the default)
        when the names are the same or unknown.

        Added in plugin API 1.18."""
        return None
