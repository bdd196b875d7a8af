"""Checkpoint formats: an HF directory of safetensors (sharded or not), a GGUF file (through the
"gguf" quantization plugin), or dummy random weights at the real shapes."""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

FORMATS = ("safetensors", "gguf", "dummy")


def detect_format(path: str, load_format: str = "auto") -> str:
    """'safetensors' | 'gguf' | 'dummy'; errors name what was found instead."""
    if load_format == "dummy":
        return "dummy"
    if not os.path.exists(path):
        raise FileNotFoundError(f"model path {path!r} does not exist")
    if os.path.isfile(path):
        if path.endswith(".gguf"):
            found = "gguf"
        else:
            raise ValueError(f"model file {path!r} is not a .gguf file; pass an HF directory or a .gguf file")
    else:
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ValueError(f"model directory {path!r} has no config.json")
        if glob.glob(os.path.join(path, "*.safetensors")):
            found = "safetensors"
        elif glob.glob(os.path.join(path, "*.bin")):
            raise ValueError(f"{path!r} holds PyTorch .bin weights; only safetensors are supported (convert them)")
        else:
            raise ValueError(f"model directory {path!r} has no *.safetensors files")
    if load_format not in ("auto", found):
        raise ValueError(f"load_format={load_format!r} but {path!r} is a {found} checkpoint")
    return found


@dataclass
class ModelSource:
    """Where a model's config and weights come from. `gguf` is the registry's GGUF component
    (a weight source) when the path is a .gguf file."""

    path: str
    format: str
    gguf: Any = None

    @property
    def is_gguf_file(self) -> bool:
        return os.path.isfile(self.path) and self.path.endswith(".gguf")

    def hf_config(self):
        if self.is_gguf_file:
            return self.gguf.hf_config(self.path)
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(self.path)

    def num_tensors(self) -> int | None:
        if self.format == "gguf":
            return self.gguf.num_tensors(self.path)
        if self.format == "safetensors":
            return None  # counted while iterating (cheap headers), see _iter_safetensors
        return 0

    def iter_weights(self, hf_config) -> Iterator[tuple[str, torch.Tensor]]:
        if self.format == "gguf":
            return self.gguf.iter_weights(self.path, hf_config)
        if self.format == "safetensors":
            return iter_safetensors(self.path)
        raise ValueError("dummy checkpoints have no weights to iterate")


def safetensors_files(path: str) -> list[str]:
    """The shard files, from model.safetensors.index.json when present."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(path, n) for n in names]
    return sorted(glob.glob(os.path.join(path, "*.safetensors")))


def iter_safetensors(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for file in safetensors_files(path):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def open_source(path: str, load_format: str = "auto", registry=None) -> ModelSource:
    fmt = detect_format(path, load_format)
    gguf = None
    if path.endswith(".gguf") and os.path.isfile(path):
        if registry is None:
            from radixserve.plugins.registry import get_registry

            registry = get_registry()
        gguf = registry.load("quantization", "gguf")()
    return ModelSource(path=path, format=fmt, gguf=gguf)
