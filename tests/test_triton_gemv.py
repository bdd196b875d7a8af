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


def test_plain_linear_layers_route_only_the_enabled_shapes(monkeypatch):
    """`use_for_shapes` sends one-row CUDA activations of the listed weight shapes to the GEMV (the
    same result as the usual path); other shapes, several rows and CPU tensors keep the usual path,
    and an empty table turns it off."""
    from radixserve.layers import quant_unquantized, triton_gemv

    calls = []
    real = triton_gemv.gemv
    monkeypatch.setattr(triton_gemv, "gemv", lambda *a: calls.append(tuple(a[1].shape)) or real(*a))
    method = quant_unquantized.UnquantizedMethod()
    layers = {}
    for n in (24, 40):
        layer = torch.nn.Module()
        method.create_weights(layer, 64, [n], torch.float32)
        layer.to(DEVICE)
        torch.nn.init.normal_(layer.weight)
        method.process_weights_after_loading(layer)
        layers[n] = layer
    x1, x2 = torch.randn(1, 64, device=DEVICE), torch.randn(2, 64, device=DEVICE)
    try:
        triton_gemv.use_for_shapes({(24, 64): GemvConfig(8, 32, 1, 1)})
        for layer in layers.values():
            torch.testing.assert_close(method.apply(layer, x1, None), F.linear(x1, layer.weight), rtol=1e-5, atol=1e-5)
            method.apply(layer, x2, None)
        assert calls == ([(24, 64)] if ON_GPU else [])
        triton_gemv.use_for_shapes({})
        method.apply(layers[24], x1, None)
        assert len(calls) == (1 if ON_GPU else 0)
    finally:
        triton_gemv.use_for_shapes({})
