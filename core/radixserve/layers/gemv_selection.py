"""Which plain-weight linear layers run batch-1 steps on the Triton GEMV (`runtime.batch1_gemv`).

The model runner calls `attach_batch1_gemv` once after loading: it gives each eligible layer a
`gemv_config` attribute (a `triton_gemv.GemvConfig`, or None for the usual cuBLAS / CPU path), and
`UnquantizedMethod.apply` runs one-row activations of that layer on the GEMV with it. The choice is
per layer and explicit: nothing is held in a process-wide table, so two runners in one process (a
drafter beside its target, a test beside another) decide independently.

Where the configs come from: benchmarks/h200/gemv_vs_cublas.py on the H200 (sm90, bf16; session 5,
benchmarks/results/h200-2026-12-04-s5/decode/gemv_vs_cublas.json, and session 6's `--selected` run,
benchmarks/results/h200-2026-12-04-s6/gemv-b/gemv_selected.txt). `SM90_MEASURED` holds the
fastest tile measured per shape (the Llama-3.1-8B, Qwen3-8B and Qwen3-30B-A3B projections; all faster
than cuBLAS). Unmeasured shapes:
- N >= 4096, K >= 2048: `SM90_UNMEASURED` = (8 rows, 512-wide K steps, 4 warps, 3 stages), the one
  tile that beat cuBLAS on every wide shape measured (8B qkv 14.4 vs 15.7 us, o 10.7 vs 13.4, gate_up
  55.8 vs 57.0, down 31.4 vs 32.1; Qwen3-8B gate_up 49.7 vs 50.1, down 27.3 vs 29.9; Qwen3-30B-A3B qkv
  5120 x 2048: 7.1 vs 8.1, the best of four tiles);
- 2048 <= N < 4096, K >= 4096: `SM90_NARROW` = (2 rows, 2048-wide K steps, 4 warps, 1 stage): on the
  one narrow shape measured (Qwen3-30B-A3B o_proj, 2048 x 4096) 6.3 us against cuBLAS's 9.3 (split K
  + reduce), where 4 and 8 rows per program took 7.3-9.3 us (fewer programs than the GPU has room for);
- smaller shapes (small models, TP shards) keep cuBLAS, which may split K to fill the GPU where
  this kernel cannot.
Other GPUs were not measured, so `auto` leaves them on cuBLAS; `on` uses the sm90 choice on any CUDA GPU.
The LM head (`ParallelLMHead`, one TP rank) gets a tile by the same rule: its batch-1 logits run on the
GEMV too (Llama-3 8B head on the H200: 230.5 us against cuBLAS's 240.3, session 8).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn

from radixserve.layers.triton_gemv import GemvConfig
from radixserve.layers.triton_support import triton_has_pdl

MODES = ("auto", "on", "off")

# (N, K) of the weight -> the fastest tile measured on the H200 (us: Triton vs cuBLAS, bf16)
SM90_MEASURED: dict[tuple[int, int], GemvConfig] = {
    (6144, 4096): GemvConfig(8, 512, 4, 3),  # Llama-3.1-8B qkv: 14.39 vs 15.72
    (4096, 4096): GemvConfig(16, 1024, 8, 2),  # o_proj: 10.29 vs 13.40
    (28672, 4096): GemvConfig(16, 256, 4, 4),  # gate_up: 55.39 vs 57.03
    (4096, 14336): GemvConfig(16, 1024, 8, 2),  # down: 29.35 vs 32.13
    (24576, 4096): GemvConfig(8, 512, 4, 3),  # Qwen3-8B gate_up: 49.67 vs 50.13 (session 6)
    (4096, 12288): GemvConfig(8, 512, 4, 3),  # Qwen3-8B down: 27.28 vs 29.91
    (5120, 2048): GemvConfig(8, 512, 4, 3),  # Qwen3-30B-A3B qkv: 7.08 vs 8.09 (16 rows 7.43, 8x1024 7.75)
    (2048, 4096): GemvConfig(2, 2048, 4, 1),  # Qwen3-30B-A3B o_proj: 6.34 vs 9.29 (4x512 7.34, 4x1024 9.32)
    (128256, 4096): GemvConfig(16, 256, 4, 4),  # Llama-3 8B LM head: 230.5 vs 240.3 (8x512 233.6; session 8)
}
SM90_UNMEASURED = GemvConfig(8, 512, 4, 3)
SM90_NARROW = GemvConfig(2, 2048, 4, 1)
MEASURED_CAPABILITIES = ((9, 0),)
_DTYPES = (torch.bfloat16, torch.float16)


def gemv_config_for_shape(n: int, k: int) -> GemvConfig | None:
    """The tile for a [n, k] weight on sm90: the measured one, else the rule's (module docstring),
    else None (cuBLAS)."""
    if (n, k) in SM90_MEASURED:
        return SM90_MEASURED[(n, k)]
    if n >= 4096 and k >= 2048:
        return SM90_UNMEASURED
    if n >= 2048 and k >= 4096:
        return SM90_NARROW
    return None


def batch1_gemv_enabled(mode: str, device: torch.device) -> bool:
    """Whether `runtime.batch1_gemv = mode` routes anything on `device`: `off` never, `on` on any
    CUDA device, `auto` on CUDA devices of a measured compute capability (sm90). Raises ValueError
    for another mode."""
    if mode not in MODES:
        raise ValueError(f"runtime.batch1_gemv={mode!r}: expected one of {', '.join(MODES)}")
    if mode == "off" or device.type != "cuda":
        return False
    return mode == "on" or torch.cuda.get_device_capability(device) in MEASURED_CAPABILITIES


def batch1_gemv_pdl_enabled(mode: str, device: torch.device) -> bool:
    """Whether `runtime.batch1_gemv_pdl = mode` gives the batch-1 GEMV tiles programmatic dependent
    launch (`GemvConfig.pdl`) on `device`: `off` never; `auto` on sm90 GPUs (where it was measured)
    when `triton_has_pdl()`; `on` on any sm90+ GPU. Never on CPU (no tiles there).
    Raises ValueError for another mode, or `on` on a CUDA GPU before sm90 (no griddepcontrol) or
    with a Triton without PDL."""
    if mode not in MODES:
        raise ValueError(f"runtime.batch1_gemv_pdl={mode!r}: expected one of {', '.join(MODES)}")
    if mode == "off" or device.type != "cuda":
        return False
    capability = torch.cuda.get_device_capability(device)
    if mode == "auto":
        return capability in MEASURED_CAPABILITIES and triton_has_pdl()
    if capability < (9, 0):
        raise ValueError(f"runtime.batch1_gemv_pdl=on needs an sm90+ GPU (programmatic dependent launch); "
                         f"this one is sm{capability[0]}{capability[1]}: use auto or off")
    if not triton_has_pdl():
        raise ValueError("runtime.batch1_gemv_pdl=on: the installed Triton has no programmatic dependent launch "
                         "(tl.extra.cuda.gdc_wait and the launch_pdl option, Triton >= 3.4): use auto or off")
    return True


def gated_config_for(tile: GemvConfig) -> GemvConfig:
    """The tile of a gated GEMV (silu_and_mul in the prologue: two activation vectors per K step)
    from the plain one: K steps halved above 8192 weights per step. Offline ptxas for sm90 gives the
    8B down projection's 16x1024 / 8-warp tile 161 registers gated against 128 plain, one program
    per SM instead of two (session 6 measured it slower: 37.4 vs 30.8 us); 16x512 takes 79. Still
    slower on the H200 (session 7: 33.7 us; the best gated tile, 8x512, 31.5 vs 30.3 for two launches),
    hence runtime.batch1_gemv_fuse_silu stays off."""
    if tile.block_n * tile.block_k > 8192:
        return dataclasses.replace(tile, block_k=tile.block_k // 2)
    return tile


def attach_batch1_gemv(model: nn.Module, mode: str, device: torch.device, pdl: bool = False,
                       fuse_norm: bool = False, fuse_silu: bool = False) -> int:
    """Set `gemv_config` on every plain-weight linear layer of `model` (those whose quant method is
    `UnquantizedMethod` or a subclass keeping its `apply`, with a 2-D bf16/fp16 weight of unit stride
    on K): the chosen tile, or None.
    The model's `ParallelLMHead` gets `gemv_config` the same way (`_attach_lm_head`).
    Returns how many layers got a tile (the head included). Call it after the weights are loaded, before CUDA graphs
    are captured. `pdl`: tiles with programmatic dependent launch on sm90+ GPUs (`GemvConfig.pdl`,
    the plain and the norm-fused GEMV; the runner passes `batch1_gemv_pdl_enabled`). `fuse_norm`
    (`runtime.batch1_gemv_fuse_norm`): sets `gemv_fuse_norm` on the layers given a tile, so that a
    decoder layer runs the RMSNorm before them inside their GEMV (radixserve.layers.norm_gemv).
    `fuse_silu` (`runtime.batch1_gemv_fuse_silu`): sets `gemv_gated_config` (`gated_config_for` the
    tile, else None) for a SwiGLU MLP to run silu_and_mul inside its down projection's GEMV."""
    from radixserve.layers.quant_unquantized import UnquantizedMethod

    enabled = batch1_gemv_enabled(mode, device)
    pdl = pdl and enabled and torch.cuda.get_device_capability(device) >= (9, 0)
    routed = 0
    for layer in model.modules():
        method = getattr(layer, "quant_method", None)
        # plain weights only: a subclass with its own `apply` (a weight source such as GGUF) may keep
        # another layout under `weight`, which the GEMV (and the MLP's fold into it) would misread
        if not isinstance(method, UnquantizedMethod) or type(method).apply is not UnquantizedMethod.apply:
            continue
        w = getattr(layer, "weight", None)
        ok = enabled and isinstance(w, torch.Tensor) and w.dim() == 2 and w.dtype in _DTYPES and w.stride(1) == 1
        layer.gemv_config = gemv_config_for_shape(*w.shape) if ok else None
        if pdl and layer.gemv_config is not None:
            layer.gemv_config = dataclasses.replace(layer.gemv_config, pdl=True)
        layer.gemv_fuse_norm = fuse_norm and layer.gemv_config is not None
        layer.gemv_gated_config = gated_config_for(layer.gemv_config) if fuse_silu and layer.gemv_config else None
        routed += layer.gemv_config is not None
    return routed + _attach_lm_head(model, enabled, pdl)


def _attach_lm_head(model: nn.Module, enabled: bool, pdl: bool) -> int:
    """The LM head's batch-1 logits on the GEMV too (`ParallelLMHead.gemv_config`): a whole-vocabulary
    head (one TP rank) that keeps the base class's `compute_logits` (not a subclass computing
    something else), bf16/fp16 weight of unit stride on K. Returns 1 if the head got a tile."""
    from radixserve.layers.embedding import ParallelLMHead

    for head in model.modules():
        if not isinstance(head, ParallelLMHead) or type(head).compute_logits is not ParallelLMHead.compute_logits:
            continue
        w = head.weight
        ok = (enabled and head.tp_size == 1 and isinstance(w, torch.Tensor) and w.dim() == 2 and w.dtype in _DTYPES
              and w.stride(1) == 1)
        tile = gemv_config_for_shape(*w.shape) if ok else None
        head.gemv_config = dataclasses.replace(tile, pdl=True) if tile is not None and pdl else tile
        return int(head.gemv_config is not None)
    return 0
