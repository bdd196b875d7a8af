"""The RMSNorm fused into the batch-1 GEMV (radixserve.layers.norm_gemv) against RMSNorm then
F.linear, in Triton's CPU interpreter without a GPU (small shapes), on CUDA with one; and when a
decoder layer takes the fused path (the runner-level greedy check is in test_triton_gemv)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from triton_interpret import round_bf16_like_gpu, use_interpreter_without_gpu

ON_GPU, _restore_interpret = use_interpreter_without_gpu()
_restore_triton_interpret = pytest.fixture(autouse=True, scope="module")(_restore_interpret)

from radixserve.layers.norm import RMSNorm  # noqa: E402
from radixserve.layers.norm_gemv import norm_linear, norm_linear_fusable, rmsnorm_gemv  # noqa: E402
from radixserve.layers.triton_gemv import GemvConfig  # noqa: E402

DEVICE = "cuda" if ON_GPU else "cpu"
TILE = GemvConfig(8, 16, 1, 1)  # several programs and K steps at these sizes


@pytest.fixture
def gpu_rounding():
    undo = None if ON_GPU else round_bf16_like_gpu()
    yield
    if undo is not None:
        undo()


def _case(n: int, k: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(1, k, generator=gen) * 3).to(dtype).to(DEVICE)
    r = torch.randn(1, k, generator=gen).to(dtype).to(DEVICE)
    norm = RMSNorm(k, 1e-5, dtype).to(DEVICE)
    norm.weight.data.copy_(1 + 0.2 * torch.randn(k, generator=gen))
    big = torch.randn(n + 3, k + 5, generator=gen) * k**-0.5
    w = big[1 : 1 + n, :k].to(dtype).to(DEVICE)  # unit stride on K, row stride k + 5
    b = torch.randn(n, generator=gen).to(dtype).to(DEVICE)
    return x, r, norm, w, b


@pytest.mark.parametrize("n, k", [(24, 64), (37, 40)], ids=["even", "ragged"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_matches_norm_then_linear(n, k, dtype, gpu_rounding):
    """With and without the residual add, with a bias: the residual stream equals `x + residual`
    bit for bit (what the next layer reads), y equals F.linear(RMSNorm(...)) to fp32 summation order
    in fp32 and to bf16 rounding in bf16 (the fused kernel never rounds the normalised row)."""
    x, r, norm, w, b = _case(n, k, dtype, n + k)
    for residual, bias in ((r, b), (None, None)):
        h, want_stream = norm(x, residual) if residual is not None else (norm(x), x)
        want = F.linear(h, w, bias)
        got, stream = rmsnorm_gemv(x, norm.weight, norm.eps, w, bias, residual, TILE)
        assert got.shape == (1, n) and got.dtype == dtype
        assert torch.equal(stream, want_stream)
        if k % TILE.block_k and dtype == torch.bfloat16:  # the PDL body (weight and norm-weight tiles loaded ahead of x, masked; no
            # griddepcontrol in the interpreter) computes in the same order: bit-equal output and stream
            got_pdl, stream_pdl = rmsnorm_gemv(x, norm.weight, norm.eps, w, bias, residual,
                                               dataclasses.replace(TILE, pdl=True))
            assert torch.equal(got_pdl, got) and torch.equal(stream_pdl, stream)
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        else:  # within two bf16 steps of the largest output
            tol = 2 * 2**-8 * want.float().abs().max().item()
            assert (got.float() - want.float()).abs().max().item() <= tol
            assert (got.float() - want.float()).norm() <= 2**-7 * want.float().norm()


def test_fused_refuses_what_it_cannot_compute():
    x, r, norm, w, b = _case(8, 16, torch.float32, 0)
    with pytest.raises(ValueError, match="one row"):
        rmsnorm_gemv(torch.cat([x, x]), norm.weight, 1e-5, w)
    with pytest.raises(ValueError, match="unit stride"):
        rmsnorm_gemv(x[:, :8], norm.weight, 1e-5, w.t())
    with pytest.raises(ValueError, match="must be \\(16,\\)"):
        rmsnorm_gemv(x, norm.weight.to(torch.bfloat16), 1e-5, w)
    with pytest.raises(ValueError, match="residual"):
        rmsnorm_gemv(x, norm.weight, 1e-5, w, residual=r[:, :8])
    with pytest.raises(ValueError, match="bias shape"):
        rmsnorm_gemv(x, norm.weight, 1e-5, w, b[:4])


def test_layers_fuse_only_with_a_tile_the_flag_and_a_plain_norm(monkeypatch):
    """norm_linear takes the fused kernel only for one row, a plain RMSNorm, a layer with a GEMV
    tile and `gemv_fuse_norm` (runtime.batch1_gemv_fuse_norm via attach_batch1_gemv), in one dtype;
    otherwise the two usual calls, with the same result."""
    from radixserve.layers import norm_gemv
    from radixserve.layers.linear import MergedColumnParallelLinear

    calls = []
    real = norm_gemv.rmsnorm_gemv
    monkeypatch.setattr(norm_gemv, "rmsnorm_gemv", lambda *a: calls.append(1) or real(*a))
    x, r, norm, _, _ = _case(8, 16, torch.float32, 1)
    linear = MergedColumnParallelLinear(16, [12, 12], params_dtype=torch.float32).to(DEVICE)
    torch.nn.init.normal_(linear.weight)
    linear.gemv_config, linear.gemv_fuse_norm = TILE, True
    h, stream = norm(x, r)
    want = F.linear(h, linear.weight)
    assert norm_linear_fusable(norm, linear, x)
    got, got_stream = norm_linear(norm, linear, x, r)
    assert len(calls) == 1 and torch.equal(got_stream, stream)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

    class OffsetNorm(RMSNorm):  # Gemma-style (1 + w): another computation
        pass

    odd = OffsetNorm(16, 1e-5).to(DEVICE)
    assert not norm_linear_fusable(odd, linear, x)
    assert not norm_linear_fusable(norm, linear, torch.cat([x, x]))
    assert not norm_linear_fusable(norm, linear, x.double())
    assert not norm_linear_fusable(norm, None, x)
    linear.gemv_fuse_norm = False  # runtime.batch1_gemv_fuse_norm=false
    assert not norm_linear_fusable(norm, linear, x)
    got, got_stream = norm_linear(norm, linear, x, r)
    assert len(calls) == 1 and torch.equal(got_stream, stream)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    linear.gemv_config, linear.gemv_fuse_norm = None, True  # no tile (cuBLAS / CPU path)
    assert not norm_linear_fusable(norm, linear, x)


@pytest.mark.parametrize("fuse_norm", [True, False])
def test_attach_marks_routed_layers_for_the_norm_fusion(monkeypatch, fuse_norm):
    """attach_batch1_gemv(fuse_norm=) marks exactly the layers it gave a tile; the config key
    defaults to on (measured faster on the H200) and is a plain boolean for an A/B."""
    from radixserve.config import Config, ConfigError
    from radixserve.layers import gemv_selection as sel
    from radixserve.layers.quant_unquantized import UnquantizedMethod

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    model = torch.nn.ModuleDict()
    for name, (n, k) in {"qkv": (6144, 4096), "small": (1024, 1024)}.items():
        layer = torch.nn.Module()
        UnquantizedMethod().create_weights(layer, k, [n], torch.bfloat16)
        layer.quant_method = UnquantizedMethod()
        model[name] = layer.to("meta")
    assert sel.attach_batch1_gemv(model, "auto", torch.device("cuda"), fuse_norm=fuse_norm) == 1
    assert model["qkv"].gemv_fuse_norm is fuse_norm and model["small"].gemv_fuse_norm is False
    assert Config.build({}).runtime.batch1_gemv_fuse_norm is True
    assert Config.build({"runtime": {"batch1_gemv_fuse_norm": False}}).runtime.batch1_gemv_fuse_norm is False
    assert Config.build({}).runtime.batch1_gemv_fuse_silu is False
    with pytest.raises(ConfigError, match="batch1_gemv_fuse_norm"):
        Config.build({"runtime": {"batch1_gemv_fuse_norm": "sometimes"}})


def test_swiglu_mlp_runs_silu_and_mul_in_the_down_gemv_when_given_a_gated_tile(monkeypatch):
    """runtime.batch1_gemv_fuse_silu: attach gives routed layers a gated tile (big tiles: K step
    halved); a SwiGLU MLP whose down projection has one runs one row through the gated GEMV, from
    `forward` and from `forward_gate_up`, with the result of the unfused MLP; several rows keep the
    usual path."""
    from radixserve.layers import gemv_selection as sel
    from radixserve.layers import triton_gemv
    from radixserve.layers.decoder_blocks import SwiGLUMLP

    assert sel.gated_config_for(GemvConfig(16, 1024, 8, 2)) == GemvConfig(16, 512, 8, 2)
    assert sel.gated_config_for(GemvConfig(8, 512, 4, 3)) == GemvConfig(8, 512, 4, 3)
    gated = []
    real = triton_gemv.gemv
    monkeypatch.setattr(triton_gemv, "gemv", lambda *a, **kw: gated.append(kw.get("gated")) or real(*a, **kw))
    torch.manual_seed(0)
    mlp = SwiGLUMLP(16, 24).to(DEVICE)
    for p in mlp.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x1, x3 = torch.randn(1, 16, device=DEVICE), torch.randn(3, 16, device=DEVICE)
    want1, want3 = mlp(x1), mlp(x3)
    want_gu = mlp.forward_gate_up(mlp.gate_up_proj(x1))
    assert gated == []
    monkeypatch.setattr(sel, "batch1_gemv_enabled", lambda mode, device: True)
    monkeypatch.setattr(sel, "gemv_config_for_shape", lambda n, k: TILE)
    monkeypatch.setattr(sel, "_DTYPES", (torch.float32,))
    assert sel.attach_batch1_gemv(mlp, "on", torch.device(DEVICE), fuse_silu=True) == 2
    assert mlp.down_proj.gemv_gated_config == TILE
    torch.testing.assert_close(mlp(x1), want1, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mlp.forward_gate_up(mlp.gate_up_proj(x1)), want_gu, rtol=1e-5, atol=1e-5)
    assert gated.count(True) == 2
    n = len(gated)
    torch.testing.assert_close(mlp(x3), want3, rtol=1e-5, atol=1e-5)
    assert len(gated) == n  # three rows: cuBLAS / CPU path
    sel.attach_batch1_gemv(mlp, "on", torch.device(DEVICE), fuse_silu=False)
    assert mlp.down_proj.gemv_gated_config is None
