"""The greedy sampler's two-launch argmax (radixserve.layers.triton_argmax) against torch.argmax, in
Triton's CPU interpreter without a GPU (small shapes), on CUDA with one."""

from __future__ import annotations

import pytest
import torch
from triton_interpret import use_interpreter_without_gpu

ON_GPU, _restore_interpret = use_interpreter_without_gpu()
_restore_triton_interpret = pytest.fixture(autouse=True, scope="module")(_restore_interpret)

from radixserve.layers.triton_argmax import argmax_rows  # noqa: E402

DEVICE = "cuda" if ON_GPU else "cpu"


def test_argmax_rows_is_torch_argmax():
    """Several chunks per row (and a ragged last one), a strided row slice (padded logits read in
    place): the first index of the maximum, as torch.argmax, including a maximum tied across chunks
    (the earlier chunk wins), an all -inf row (index 0), +inf, and NaN (the first NaN beats
    everything, an earlier +inf too)."""
    gen = torch.Generator().manual_seed(0)
    v, block = 300, 64  # 5 chunks, the last 44 wide
    padded = torch.randn(4, v + 12, generator=gen)
    x = padded[:, :v]
    x[0, 250] = x[0, 100] = x[0, 110] = 50.0  # tied across chunks and within the earlier one
    x[1] = float("-inf")  # all tied: index 0
    x[2, 20] = float("inf")
    x[2, 150] = x[2, 200] = float("nan")
    x[3, 299] = 80.0  # the ragged chunk's last column
    x = x.to(DEVICE)
    got = argmax_rows(x, block=block)
    assert got.dtype == torch.int64
    assert got.tolist() == torch.argmax(x, dim=-1).tolist() == [100, 0, 150, 299]
    assert argmax_rows(x[:1].to(torch.bfloat16), block=block).tolist() == torch.argmax(x[:1].to(torch.bfloat16), -1).tolist()
    assert argmax_rows(x[:0], block=block).shape == (0,)
    with pytest.raises(ValueError, match="unit stride"):
        argmax_rows(x.t(), block=block)
