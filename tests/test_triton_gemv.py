"""The batch-1 Triton GEMV (radixserve.layers.triton_gemv) against torch's F.linear, in Triton's CPU
interpreter without a GPU (small shapes), on CUDA with one."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from triton_interpret import use_interpreter_without_gpu

ON_GPU, _restore_interpret = use_interpreter_without_gpu()
_restore_triton_interpret = pytest.fixture(autouse=True, scope="module")(_restore_interpret)

from radixserve.layers.triton_gemv import GemvConfig, gemv  # noqa: E402

DEVICE = "cuda" if ON_GPU else "cpu"


@pytest.mark.parametrize("n, k", [(24, 64), (37, 100), (8, 32)], ids=["even", "ragged", "one-block"])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gemv_matches_linear(n, k, with_bias):
    """Ragged N and K (masked tails), bias, a weight that is a row slice of a bigger matrix (row
    stride != K), a 1-D x: equal to F.linear up to fp32 summation order."""
    gen = torch.Generator().manual_seed(n + k)
    big = torch.randn(n + 5, k + 3, generator=gen).to(DEVICE)
    w = big[2 : 2 + n, :k]  # unit stride on K, row stride k + 3
    x = torch.randn(1, k, generator=gen).to(DEVICE)
    b = torch.randn(n, generator=gen).to(DEVICE) if with_bias else None
    want = F.linear(x, w, b)
    got = gemv(x, w, b)
    assert got.shape == (1, n)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gemv(x[0], w, b), want[0], rtol=1e-5, atol=1e-5)
    # another tile shape (several programs, several K steps) gives the same answer
    torch.testing.assert_close(gemv(x, w, b, GemvConfig(4, 16, 1, 1)), want, rtol=1e-5, atol=1e-5)


def test_gemv_refuses_what_it_cannot_compute():
    w = torch.zeros(8, 16, device=DEVICE)
    with pytest.raises(ValueError, match="one row"):
        gemv(torch.zeros(2, 16, device=DEVICE), w)
    with pytest.raises(ValueError, match="unit stride"):
        gemv(torch.zeros(1, 8, device=DEVICE), w.t())
    with pytest.raises(ValueError, match="bias shape"):
        gemv(torch.zeros(1, 16, device=DEVICE), w, torch.zeros(4, device=DEVICE))
