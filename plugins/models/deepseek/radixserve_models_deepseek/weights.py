"""Checkpoint names -> DeepSeek parameters, and FP8 weights of the modules this model keeps
unquantized (`kv_b_proj` always; `kv_a_proj_with_mqa` under 128x128 blocks), dequantized at load."""

from __future__ import annotations

import re

import torch
from radixserve.layers.weight_utils import load_into

FP8_DTYPES = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n))
SCALE_SUFFIXES = (".weight_scale_inv", ".weight_scale")  # block scales (DeepSeek-V3), per-tensor scalar
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")

# HF name piece -> (our fused parameter piece, shard id) for the dense MLP and the shared experts;
# RENAMED: the router's correction bias lives on the routed experts here
STACKED = ((".gate_proj.", ".gate_up_proj.", 0), (".up_proj.", ".gate_up_proj.", 1))
RENAMED = ((".mlp.gate.e_score_correction_bias", ".mlp.experts.e_score_correction_bias"),)


def checkpoint_layer(name: str) -> int | None:
    """The decoder-layer index a checkpoint name belongs to (None outside `model.layers.N.`)."""
    match = _LAYER.match(name)
    return int(match.group(1)) if match else None


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """fp32 W from an FP8 weight [out, in] and its scale: a scalar, or one per `block` tile
    ([ceil(out/bo), ceil(in/bi)], the last tiles possibly partial). Raises ValueError on a scale
    whose shape fits neither."""
    w = weight.to(torch.float32)
    s = scale.to(torch.float32)
    if s.numel() == 1:
        return w * s.reshape(())
    bo, bi = block
    want = (-(-w.shape[0] // bo), -(-w.shape[1] // bi))
    if tuple(s.shape) != want:
        raise ValueError(f"fp8 scale of shape {tuple(s.shape)} does not fit a {tuple(w.shape)} weight in "
                         f"{bo}x{bi} blocks (expected {want})")
    full = s.repeat_interleave(bo, 0).repeat_interleave(bi, 1)
    return w * full[: w.shape[0], : w.shape[1]]


class FP8ToFloatLoader:
    """Gathers the FP8 `weight` and its scale of a parameter that is a float tensor in this model
    (the two may arrive in any order), and loads the dequantized weight once both are in.

    :param params: the model's `named_parameters()` as a dict.
    :param block: the checkpoint's `weight_block_size` (DeepSeek-V3: 128x128)."""

    def __init__(self, params: dict[str, torch.Tensor], block: tuple[int, int]) -> None:
        self.params = params
        self.block = block
        self._weights: dict[str, torch.Tensor] = {}  # parameter name -> fp8 tensor
        self._scales: dict[str, torch.Tensor] = {}

    def _target_of_scale(self, name: str) -> str | None:
        for suffix in SCALE_SUFFIXES:
            if name.endswith(suffix) and name not in self.params:
                target = name[: -len(suffix)] + ".weight"
                param = self.params.get(target)
                if param is not None and param.dtype not in FP8_DTYPES:
                    return target
        return None

    def offer(self, name: str, tensor: torch.Tensor) -> tuple[bool, str | None]:
        """Take `name` if it is such a weight or scale: (taken, the parameter now loaded or None)."""
        target = self._target_of_scale(name)
        if target is not None:
            self._scales[target] = tensor
        elif tensor.dtype in FP8_DTYPES and name in self.params and self.params[name].dtype not in FP8_DTYPES:
            target = name
            self._weights[target] = tensor
        else:
            return False, None
        if target in self._weights and target in self._scales:
            load_into(self.params[target], dequantize_fp8(self._weights.pop(target), self._scales.pop(target),
                                                          self.block))
            return True, target
        return True, None

    def check_complete(self) -> None:
        """ValueError naming an FP8 weight that came without its scale (or a scale without weight)."""
        for target in self._weights:
            raise ValueError(f"checkpoint tensor {target!r} is float8 but its scale ({target[:-7]}.weight_scale_inv) "
                             "is missing; it cannot be dequantized")
        for target in self._scales:
            raise ValueError(f"checkpoint has a scale for {target!r} but that weight is not float8 or is missing")
