"""A fast GGUF reader: header, metadata and tensor index parsed with `struct` over an mmap.

`gguf.GGUFReader` builds numpy views for every element of every metadata array, which takes
seconds for a 49k-token vocabulary; this parser reads the same facts in a fraction of that and
exposes the attributes the rest of the plugin uses (`fields` as plain Python values, `tensors`
with name / tensor_type / shape (GGUF order) / data as numpy views over the mmap)."""

from __future__ import annotations

import functools
import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NP = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32, 7: np.bool_,
       10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9


@dataclass
class GGUFTensor:
    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: list[int]  # GGUF order: innermost dimension first
    data: np.ndarray  # F32/F16: values in HF order; quantized: uint8 [rows..., bytes per row]


class GGUFFile:
    def __init__(self, path: str) -> None:
        with open(path, "rb") as f:
            self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self.path = path
        self._pos = 0
        if self._read(4) != b"GGUF":
            raise ValueError(f"{path!r} is not a GGUF file (bad magic)")
        self.version = self._scalar(4)
        if self.version < 2:
            raise ValueError(f"{path!r}: GGUF version {self.version} is not supported (need >= 2)")
        n_tensors, n_kv = self._scalar(10), self._scalar(10)
        self.fields: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self._string()
            self.fields[key] = self._value(self._scalar(4))
        infos = [self._tensor_info() for _ in range(n_tensors)]
        align = int(self.fields.get("general.alignment", 32))
        data_start = -(-self._pos // align) * align
        self.tensors = [self._tensor(name, dims, kind, data_start + off) for name, dims, kind, off in infos]

    # ---- primitive readers ----------------------------------------------------------------
    def _read(self, n: int) -> bytes:
        b = self._mm[self._pos : self._pos + n]
        self._pos += n
        return b

    def _scalar(self, kind: int):
        fmt = _SCALARS[kind]
        (v,) = struct.unpack_from(fmt, self._mm, self._pos)
        self._pos += struct.calcsize(fmt)
        return v

    def _string(self) -> str:
        n = self._scalar(10)
        return self._read(n).decode("utf-8", errors="replace")

    def _value(self, kind: int):
        if kind == _STRING:
            return self._string()
        if kind == _ARRAY:
            item, count = self._scalar(4), self._scalar(10)
            if item == _STRING:
                return [self._string() for _ in range(count)]
            if item == _ARRAY:
                return [self._value(_ARRAY) for _ in range(count)]
            arr = np.frombuffer(self._mm, dtype=_NP[item], count=count, offset=self._pos)
            self._pos += arr.nbytes
            return arr.tolist()
        return self._scalar(kind)

    def _tensor_info(self):
        name = self._string()
        dims = [self._scalar(10) for _ in range(self._scalar(4))]
        return name, dims, self._scalar(4), self._scalar(10)

    def _tensor(self, name: str, dims: list[int], kind: int, offset: int) -> GGUFTensor:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        qtype = GGMLQuantizationType(kind)
        block, type_size = GGML_QUANT_SIZES[qtype]
        hf_shape = list(reversed(dims))
        if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            dtype = np.float32 if qtype == GGMLQuantizationType.F32 else np.float16
            data = np.frombuffer(self._mm, dtype=dtype, count=int(np.prod(dims)), offset=offset).reshape(hf_shape)
        else:
            row_bytes = dims[0] // block * type_size
            rows = int(np.prod(dims[1:])) if len(dims) > 1 else 1
            data = np.frombuffer(self._mm, dtype=np.uint8, count=rows * row_bytes, offset=offset)
            data = data.reshape(*hf_shape[:-1], row_bytes)
        return GGUFTensor(name, qtype, dims, data)


@functools.lru_cache(maxsize=2)
def _open(path: str, mtime: float) -> GGUFFile:
    return GGUFFile(path)


def open_gguf(path: str) -> GGUFFile:
    """A cached parsed GGUF file for `path` (re-read when the file changes)."""
    path = os.path.abspath(path)
    return _open(path, os.path.getmtime(path))


def release() -> None:
    """Drop the cached parsed files: their mmaps (the file's pages, counted in the process's RSS
    once read) go away with the last view into them. Called when the weights are loaded."""
    _open.cache_clear()


def field(reader: GGUFFile, key: str, default: Any = None) -> Any:
    return reader.fields.get(key, default)
