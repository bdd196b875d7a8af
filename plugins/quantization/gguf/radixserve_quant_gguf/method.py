"""The "gguf" quantization component: a weight source (declared for ".gguf" files) that either
keeps the file's blocks or dequantizes them at load.

Kept quantized (`dequantize: auto` or `false`; CPU, every decoder linear of the file one of Q4_0,
Q4_1, Q8_0, tp_size 1, native kernels built): each linear holds its tensor's blocks unchanged
(uint8 [out, in / 32 * block bytes]) and computes with the native integer kernels over int16 (or,
with `activations: int8`, llama.cpp's int8) activations (kernels.py); a Q4_0/Q4_1/Q8_0 token
embedding stays in blocks too (rows dequantized on lookup), and the LM head, tied or the file's own
`output.weight`, computes with the same kernel.
Dequantized (the default, `dequantize: true`, and wherever blocks cannot stay): plain fp32
weights, as transformers loads the file.

Reading the file is the WeightSource contract: `hf_config(path)`, `num_tensors(path)`,
`iter_weights(path, hf_config)`, `prepare_model(model)`."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator

import numpy as np
import torch
import torch.nn as nn
from radixserve import native
from radixserve.interfaces.quantization import WeightSource
from radixserve.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from radixserve.layers.quant_unquantized import UnquantizedMethod
from radixserve.layers.weight_utils import set_weight_attrs

from radixserve_quant_gguf import kernels
from radixserve_quant_gguf.hf_config import build_hf_config, gguf_architecture
from radixserve_quant_gguf.reader import open_gguf, release
from radixserve_quant_gguf.tensors import LINEAR_SUFFIXES, gguf_name, hf_name, iter_hf_tensors, unpermute_qk

logger = logging.getLogger(__name__)


class GGUFMethod(UnquantizedMethod, WeightSource):
    """Options (`model.weight_source_options`): `dequantize` — True (default): dequantize to fp32
    at load (the weights transformers computes with: greedy outputs token for token);
    "auto": keep the file's blocks where that is possible (CPU, every decoder linear
    Q4_0/Q4_1/Q8_0 of one type, native kernels built, tp_size 1: ~4x less model memory, ~3x
    faster batch-1 decode; benchmarks/results/cpu-gguf-quantized.md), else dequantize, logging why;
    False: keep the blocks and refuse to start, naming why, where that is not possible.
    `activations` — what kept blocks quantize the activations to, per 32-input block: "int16"
    (default: ~0.002% of a block's largest value; SmolLM2's greedy answers equal the fp32 path's on
    the prompts checked) or "int8" (llama.cpp's arithmetic, a few % faster at batch 1, 0.4%: enough
    to move greedy choices: "What is the capital of France?" -> "L'Étoile, ..." instead of "The
    capital of France is Paris."). Either way kept outputs follow the top-5 rule against fp32
    rather than matching it by construction, which is why dequantizing stays the default."""

    def __init__(self, dequantize: bool | str = True, activations: str = "int16") -> None:
        if not (isinstance(dequantize, bool) or dequantize == "auto"):  # not `in (True, False, ...)`: 1 == True
            raise ValueError(f"GGUF option dequantize must be true, false or auto, got {dequantize!r}")
        if activations not in kernels.ACTIVATION_BITS:
            raise ValueError(f"GGUF option activations must be one of {', '.join(kernels.ACTIVATION_BITS)}, "
                             f"got {activations!r}")
        self.dequantize: bool | None = None if dequantize == "auto" else dequantize  # None: auto
        self.activations = activations
        self.act_bits = kernels.ACTIVATION_BITS[activations]
        self.path: str | None = None
        self.keep: bool | None = None  # decided at the first linear (the device is known then)
        self.linear_type: str | None = None

    # ---- WeightSource ---------------------------------------------------------------------
    def hf_config(self, path: str):
        self.path = path
        if self.dequantize is not True and not torch.cuda.is_available():
            # a first start compiles the block kernels (about a minute on 2 cores): begin now, beside
            # the core's kernels and the model set-up, instead of when the first linear decides
            native.build_in_background([kernels.load])
        return build_hf_config(open_gguf(path))

    @staticmethod
    def num_tensors(path: str) -> int:
        return len(open_gguf(path).tensors)

    @staticmethod
    def file_tensor_name(name: str) -> str | None:
        return gguf_name(name)  # error messages name blk.1.ffn_down.weight too

    def iter_weights(self, path: str, hf_config) -> Iterator[tuple[str, torch.Tensor]]:
        try:
            yield from self._iter_weights(path, hf_config)
        finally:  # every tensor is copied out: the file's pages need not stay resident
            release()

    def _iter_weights(self, path: str, hf_config) -> Iterator[tuple[str, torch.Tensor]]:
        reader = open_gguf(path)
        arch = gguf_architecture(reader)
        heads, kv_heads = hf_config.num_attention_heads, hf_config.num_key_value_heads
        if not self.keep:
            yield from iter_hf_tensors(reader, arch, heads, kv_heads)
            return
        kept = set(self._kept_table_names(reader))
        for t in reader.tensors:
            name = hf_name(t.name)
            if name is None:
                continue
            if not (t.name.endswith(LINEAR_SUFFIXES) or t.name in kept):
                yield from iter_hf_tensors(reader, arch, heads, kv_heads, only=t)
                continue
            blocks = torch.from_numpy(np.array(t.data, copy=True))  # [rows, row bytes], as in the file
            if arch == "llama" and name.endswith("q_proj.weight"):
                blocks = unpermute_qk(blocks, heads)  # whole rows move: the blocks stay intact
            elif arch == "llama" and name.endswith("k_proj.weight"):
                blocks = unpermute_qk(blocks, kv_heads)
            yield name, blocks

    def prepare_model(self, model: nn.Module) -> nn.Module:
        """Kept quantized: put BlockEmbedding / BlockLMHead in place of the float embedding and
        head whose file tensors are Q4_0/Q4_1/Q8_0 (before loading, so no float table is filled).
        Either way, on the CPU, the plain Llama layers get the core's flat forward over this method's
        linears (on a GPU nothing: it would compile the CPU kernels for a wrapper that never runs)."""
        from radixserve_quant_gguf import fast_layer

        param = next(model.parameters(), None)
        if param is not None and param.is_cpu:  # the flat forward runs the native CPU kernels only
            fast_layer.install(model)  # batch-1 decode: the layers' Python overhead was half a step
        if not self.keep:
            return model
        from radixserve_quant_gguf.kept import BlockEmbedding, BlockLMHead

        types = self._kept_table_names(open_gguf(self.path))
        swaps: dict[str, nn.Module] = {}
        embed_weight, new_embed = None, None
        for name, module in model.named_modules():
            if type(module) is VocabParallelEmbedding and "token_embd.weight" in types:
                embed_weight, new_embed = module.weight, BlockEmbedding(module, types["token_embd.weight"])
                swaps[name] = new_embed
        for name, module in model.named_modules():
            if type(module) is not ParallelLMHead:
                continue
            if new_embed is not None and module.weight is embed_weight:  # tied
                head = BlockLMHead(module, new_embed.qtype, self.act_bits)
                head.tie_to(new_embed)
                swaps[name] = head
            elif "output.weight" in types:
                swaps[name] = BlockLMHead(module, types["output.weight"], self.act_bits)
        for name, new in swaps.items():
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, new)
        return model

    # ---- QuantMethod ----------------------------------------------------------------------
    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int], dtype: torch.dtype) -> None:
        if self.keep is None:
            self.keep = self._decide(getattr(layer, "tp_size", 1))
        if not self.keep:
            return super().create_weights(layer, input_size, output_sizes, dtype)
        rows = kernels.row_bytes(self.linear_type, input_size)
        weight = nn.Parameter(torch.empty(sum(output_sizes), rows, dtype=torch.uint8), requires_grad=False)
        set_weight_attrs(weight, {"output_dim": 0, "weight_loader": layer.weight_loader})
        layer.register_parameter("weight", weight)
        layer.gguf_qtype = self.linear_type
        layer.gguf_act_bits = self.act_bits

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if not self.keep:
            super().process_weights_after_loading(layer)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if not self.keep:
            return super().apply(layer, x, bias)
        y = kernels.linear(x, layer.weight, layer.gguf_qtype, layer.gguf_act_bits)
        return y if bias is None else y + bias

    # ---- the choice -----------------------------------------------------------------------
    def _decide(self, tp_size: int) -> bool:
        """Whether the layers keep the blocks; logs the path taken (one line). Raises ValueError
        naming why when `dequantize=False` asked for blocks that cannot stay."""
        name = os.path.basename(self.path) if self.path else "(no file read)"
        if self.dequantize:
            logger.info("GGUF %s: dequantized to fp32 at load (weight_source_options dequantize: true)", name)
            return False
        why, linear_type = self._why_not_kept(tp_size)
        if why is None:
            self.linear_type = linear_type
            logger.info("GGUF %s: %s weights kept quantized (%s activations, %s kernels)%s", name, linear_type,
                        self.activations, kernels.isa(),
                        "" if self.dequantize is False else "; weight_source_options dequantize: true for the fp32 "
                        "path (parity with transformers)")
            return True
        if self.dequantize is False:
            raise ValueError(f"model.weight_source_options dequantize=false: cannot keep {self.path!r} quantized: "
                             f"{why}; drop the option (or use auto) to dequantize at load")
        logger.info("GGUF %s: dequantized to fp32 at load: %s", name, why)
        return False

    def _why_not_kept(self, tp_size: int) -> tuple[str | None, str | None]:
        """(why the blocks cannot stay, or None; the one block type of the file's linears)."""
        device = torch.get_default_device()
        if device.type != "cpu":
            return f"the block kernels run on the CPU (device is {device.type})", None
        if tp_size > 1:
            return f"tensor parallelism (tp_size {tp_size}) needs float weights", None
        if self.path is None:  # built as a plain QuantMethod (no hf_config call): no blocks to keep
            return "no GGUF file was read", None
        linears = [t for t in open_gguf(self.path).tensors if t.name.endswith(LINEAR_SUFFIXES)]
        if not linears:
            return "the file has no decoder linear tensors the kernels know", None
        other = next((t for t in linears if t.tensor_type.name not in kernels.KEPT_TYPES), None)
        if other is not None:
            return (f"{other.name} is {other.tensor_type.name}; the kernels keep files whose linears are all one "
                    f"of {', '.join(kernels.KEPT_TYPES)}"), None
        types = {t.tensor_type.name: t.name for t in linears}  # one tensor of each type, to name it
        if len(types) != 1:
            named = ", ".join(f"{tensor} is {qtype}" for qtype, tensor in sorted(types.items()))
            return f"the linears mix block types ({named}); the kernels keep files of one type", None
        if kernels.load() is None:
            return "the native block kernels could not be built here (see the log)", None
        return None, next(iter(types))

    @staticmethod
    def _kept_table_names(reader) -> dict[str, str]:
        """The embedding / LM-head tensors whose type the kernels read: {gguf name: type}."""
        return {t.name: t.tensor_type.name for t in reader.tensors
                if t.name in ("token_embd.weight", "output.weight") and t.tensor_type.name in kernels.KEPT_TYPES}
