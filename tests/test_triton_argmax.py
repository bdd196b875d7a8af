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
    v, block = 1000, 128  # 8 chunks, the last 104 wide
    padded = torch.randn(7, v + 24, generator=gen)
    x = padded[:, :v]
    x[1, 700] = x[1, 300] = 50.0  # a tie across chunks
    x[1, 310] = 50.0  # and within the earlier one
    x[2] = float("-inf")
    x[3, 900] = float("inf")
    x[4, 20] = float("inf")
    x[4, 500] = float("nan")
    x[4, 640] = float("nan")
    x[5, 999] = 80.0  # the ragged chunk's last column
    x[6, :] = 1.0  # all tied: index 0
    x = x.to(DEVICE)
    got = argmax_rows(x, block=block)
    assert got.dtype == torch.int64
    assert got.tolist() == torch.argmax(x, dim=-1).tolist() == [got[0].item(), 300, 0, 900, 500, 999, 0]
    assert argmax_rows(x[:1].to(torch.bfloat16), block=block).tolist() == torch.argmax(x[:1].to(torch.bfloat16), -1).tolist()
    assert argmax_rows(x[:0], block=block).shape == (0,)
    with pytest.raises(ValueError, match="unit stride"):
        argmax_rows(x.t(), block=block)
