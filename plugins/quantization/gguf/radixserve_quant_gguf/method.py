"""The "gguf" quantization component: a weight source (declared for ".gguf" files) that
dequantizes GGUF files at load time.

Layers stay unquantized (plain float weights); what this component adds is reading the file
(the WeightSource contract): `hf_config(path)`, `num_tensors(path)`, `iter_weights(path, hf_config)`."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from radixserve.interfaces.quantization import WeightSource
from radixserve.layers.quant_unquantized import UnquantizedMethod

from radixserve_quant_gguf.hf_config import build_hf_config, gguf_architecture
from radixserve_quant_gguf.reader import open_gguf
from radixserve_quant_gguf.tensors import iter_hf_tensors


class GGUFMethod(UnquantizedMethod, WeightSource):
    @staticmethod
    def hf_config(path: str):
        return build_hf_config(open_gguf(path))

    @staticmethod
    def num_tensors(path: str) -> int:
        return len(open_gguf(path).tensors)

    @staticmethod
    def iter_weights(path: str, hf_config) -> Iterator[tuple[str, torch.Tensor]]:
        reader = open_gguf(path)
        yield from iter_hf_tensors(
            reader, gguf_architecture(reader), hf_config.num_attention_heads, hf_config.num_key_value_heads
        )
