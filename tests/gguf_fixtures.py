"""GGUF Q4_0 / Q4_1 / Q8_0 weights built byte by byte in the published block layouts (ggml's
block_q4_0 / block_q4_1 / block_q8_0), independent of the plugin: each block of 32 inputs is
  Q4_0: f16 d, 16 bytes; byte j = code[j] | code[j + 16] << 4; value = d * (code - 8)
  Q4_1: f16 d, f16 m, 16 bytes as Q4_0;                        value = d * code + m
  Q8_0: f16 d, 32 int8 codes;                                  value = d * code
`expected` gives the values from the codes and scales directly (fp32 products, as ggml)."""

from __future__ import annotations

import numpy as np


def build(qtype: str, rows: int, cols: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(blocks uint8 [rows, cols / 32 * block bytes], expected fp32 [rows, cols])."""
    rng = np.random.default_rng(seed)
    nb = cols // 32
    d = (rng.uniform(0.002, 0.05, (rows, nb)) * rng.choice([-1, 1], (rows, nb))).astype(np.float16)
    if qtype == "Q8_0":
        codes = rng.integers(-127, 128, (rows, nb, 32)).astype(np.int8)
        blocks = np.concatenate([d[..., None].view(np.uint8), codes.view(np.uint8)], axis=-1)
        expected = d.astype(np.float32)[..., None] * codes.astype(np.float32)
    else:
        codes = rng.integers(0, 16, (rows, nb, 32)).astype(np.uint8)
        nibbles = codes[..., :16] | (codes[..., 16:] << 4)
        if qtype == "Q4_0":
            blocks = np.concatenate([d[..., None].view(np.uint8), nibbles], axis=-1)
            expected = d.astype(np.float32)[..., None] * (codes.astype(np.float32) - 8)
        else:
            m = rng.uniform(-0.3, 0.3, (rows, nb)).astype(np.float16)
            blocks = np.concatenate([d[..., None].view(np.uint8), m[..., None].view(np.uint8), nibbles], axis=-1)
            expected = d.astype(np.float32)[..., None] * codes.astype(np.float32) + m.astype(np.float32)[..., None]
    return np.ascontiguousarray(blocks.reshape(rows, -1)), expected.reshape(rows, cols).astype(np.float32)
