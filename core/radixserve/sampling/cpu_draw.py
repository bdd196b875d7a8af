"""The CPU sampler's fused draw (csrc/sample_rows.cpp): one draw per row of fp32 logits from
softmax(logits / temperature) by an inverse-CDF search, its one uniform made from the row's key.

Why: torch's exponential_ noise for a [16, 49152] batch costs ~30 ms of one core per decode step on
the AVX2 CI machine, more than the rest of the sampling; the kernel's whole draw is ~3 ms.
`Sampler` uses it for rows without top-k/top-p/min-p on CPU fp32 logits; anything else keeps the
torch path. Compiled on first use by `radixserve.native` (None without a compiler or with
RADIXSERVE_NATIVE=0)."""

from __future__ import annotations

from pathlib import Path

import torch

from radixserve import native

_SOURCE = Path(__file__).resolve().parent.parent / "csrc" / "sample_rows.cpp"
KEY_BITS = 63  # row keys are non-negative int64


def _kernels():
    return native.load_extension("radixserve_sample_rows", _SOURCE)


def available(logits: torch.Tensor) -> bool:
    """True for fp32 CPU [rows, V] logits with contiguous rows, once the kernel is built."""
    return (logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2
            and logits.stride(1) == 1 and _kernels() is not None)


def sample_rows(logits: torch.Tensor, temperatures: torch.Tensor, greedy: torch.Tensor,
                keys: torch.Tensor) -> torch.Tensor:
    """int64 [rows]: greedy rows their argmax (torch.argmax semantics), the others one draw from
    softmax(logits / temperature) determined by the row's key (int64 [rows], 0 <= key < 2**63);
    -1 for a sampled row whose logits hold a NaN or +inf or are all -inf."""
    inv_t = (1.0 / temperatures.float()).contiguous()
    return _kernels().sample_rows(logits, inv_t, greedy.contiguous(), keys.contiguous())
