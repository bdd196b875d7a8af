"""runtime.cpu_matmul_precision=medium: the native GEMM over bf16 panels (this CPU's build; the AVX2
build's widened panels are in test_native_cpu_kernels.py).

What a user relies on: the products are those of the bf16-rounded inputs summed in fp32 (so the
results match torch on bf16-rounded operands, and really differ from the fp32 GEMM), or, where
vdpbf16ps is the slower instruction or missing (`widen`), of fp32 x and the bf16-rounded weights; NaN stays in
its row; a model loaded with the option runs its linears on bf16 panels, keeps each request's
tokens independent of its batch, and stays close to the fp32 model. The kernels are tested where
the native GEMM runs, the vdpbf16ps product where the CPU has AVX-512 BF16 too (skipped, and said so,
elsewhere); the fallback warning everywhere."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from radixserve.layers import cpu_gemm
from radixserve.layers.activation import SiluAndMul


@pytest.fixture(scope="module")
def gemm():
    if not cpu_gemm.bf16_available():
        pytest.skip("no native GEMM here (AVX2 and a compiler): runtime.cpu_matmul_precision=medium stays fp32")
    return cpu_gemm._native_gemm()


def _needs_product(gemm, widen: bool) -> None:
    """The vdpbf16ps product (widen=False) exists only where the CPU has AVX-512 BF16."""
    if not widen and not gemm.bf16_dot_available():
        pytest.skip("this CPU has no AVX-512 BF16: its bf16 panels are only ever widened")


def _bf16(t: torch.Tensor) -> torch.Tensor:
    return t.bfloat16().float()


def _tolerance(in_features: int) -> dict:
    return {"rtol": 1e-5, "atol": 1e-4 * max(1.0, in_features / 1000)}


@pytest.mark.parametrize(
    ("rows", "out_features", "in_features"),
    [(r, n, k) for r in (1, 5, 8, 13, 300) for n, k in ((960, 576), (50, 1536), (24, 7))] + [(9, 100, 2500)],
)
@pytest.mark.parametrize("widen", [False, True])
def test_bf16_panels_compute_the_bf16_rounded_product(gemm, rows, out_features, in_features, widen):
    """Partial panels, odd K (a zero-padded last pair; widened, x has no value there to read), every
    row remainder of the 8-row kernel, row chunks (300 rows) and K blocks (2500 features: 1250 pairs,
    past the 1024-pair block)."""
    _needs_product(gemm, widen)
    gen = torch.Generator().manual_seed(rows * out_features + in_features)
    weight, x = torch.randn(out_features, in_features, generator=gen), torch.randn(rows, in_features, generator=gen)
    panels = gemm.to_bf16_panels(gemm.pack(weight))
    width = gemm.panel_width()  # 48 (AVX-512) or 24 (AVX2)
    assert panels.dtype == torch.int16 and panels.shape == (-(-out_features // width), (in_features + 1) // 2, width, 2)
    got = gemm.linear(x, panels, out_features, widen)
    torch.testing.assert_close(got, F.linear(x if widen else _bf16(x), _bf16(weight)), **_tolerance(in_features))
    if in_features > 16:  # really rounded: the fp32 product is measurably elsewhere
        assert (got - F.linear(x, weight)).abs().max() > 1e-3
    if widen and in_features > 16:  # and x really is not: the all-bf16 product is elsewhere too
        assert (got - F.linear(_bf16(x), _bf16(weight))).abs().max() > 1e-3


@pytest.mark.parametrize("widen", [False, True])
@pytest.mark.parametrize(("rows", "inter", "in_features"), [(1, 50, 40), (9, 100, 40), (64, 1536, 40), (300, 100, 1536)])
def test_bf16_silu_gated_panels(gemm, rows, inter, in_features, widen):
    """The last case spans several row chunks (300 rows of 1536 bf16 features)."""
    _needs_product(gemm, widen)
    gen = torch.Generator().manual_seed(rows + inter)
    weight = torch.randn(2 * inter, in_features, generator=gen) / in_features**0.5  # unit-scale pre-activations
    x = torch.randn(rows, in_features, generator=gen)
    panels = gemm.to_bf16_panels(gemm.pack_gated(weight))
    want = SiluAndMul()(F.linear(x if widen else _bf16(x), _bf16(weight)))
    torch.testing.assert_close(gemm.linear_silu_mul(x, panels, inter, widen), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("widen", [False, True])
def test_a_nan_stays_in_its_row(gemm, widen):
    _needs_product(gemm, widen)
    weight, x = torch.randn(100, 64), torch.randn(3, 64)
    x[1, 5] = float("nan")
    got = gemm.linear(x, gemm.to_bf16_panels(gemm.pack(weight)), 100, widen)
    assert got[1].isnan().all() and not got[0].isnan().any() and not got[2].isnan().any()


def test_the_product_kind_follows_the_measured_instruction_rates(gemm):
    """vdpbf16ps where it does more FLOPs a second than the fp32 FMA (Zen 4: ~2x), widened weights
    where fewer (Sapphire / Emerald Rapids: ~0.5x) or where there is none (Ice Lake: rate 0); every
    bf16 packing takes this process's choice."""
    rate = gemm.dot_to_fma_rate()
    if gemm.bf16_dot_available():
        assert 0.1 < rate < 8, rate  # a measurement, not a constant: some real ratio of two rates
    else:
        assert rate == 0.0 and cpu_gemm.bf16_products_widened()
    assert cpu_gemm.bf16_products_widened() == (rate < 1.0) or abs(rate - 1.0) < 0.2  # measured twice: noise at 1
    packed = cpu_gemm.to_bf16(cpu_gemm.pack(torch.randn(48, 64)))
    assert packed.widen == cpu_gemm.bf16_products_widened()
    assert cpu_gemm.to_bf16(cpu_gemm.pack(torch.randn(48, 64)), widen=True).widen


def test_mismatched_bf16_panels_are_refused(gemm):
    panels = gemm.to_bf16_panels(gemm.pack(torch.randn(48, 64)))
    with pytest.raises(RuntimeError, match="bf16 panels do not match x"):
        gemm.linear(torch.randn(2, 66), panels, 48, True)


def test_the_vdpbf16ps_product_is_refused_where_the_build_has_none(gemm):
    """AVX-512 without BF16 (Ice Lake): the panels run widened, and asking for vdpbf16ps is an error,
    not the widened product under the other name."""
    if gemm.bf16_dot_available():
        pytest.skip("this CPU has AVX-512 BF16: both products run here")
    panels = gemm.to_bf16_panels(gemm.pack(torch.randn(48, 64)))
    with pytest.raises(RuntimeError, match="vdpbf16ps products need a build with AVX-512 BF16"):
        gemm.linear(torch.randn(2, 64), panels, 48, False)


def test_packed_weight_converts_once_and_keeps_its_kind(gemm):
    weight = torch.randn(2 * 96, 64)
    gated = cpu_gemm.pack_silu_gated(weight)
    low = cpu_gemm.to_bf16(gated)
    assert low.bf16 and low.silu_gated and low.out_features == 96 and not gated.bf16
    assert cpu_gemm.to_bf16(low) is low
    x = torch.randn(4, 64)
    want = SiluAndMul()(F.linear(x if low.widen else _bf16(x), _bf16(weight)))  # the kind this CPU runs faster
    torch.testing.assert_close(cpu_gemm.silu_gated_linear(x, low), want, rtol=1e-5, atol=1e-4)


def _runner(path: str, precision: str):
    from radixserve.config import Config
    from radixserve.model_runner import ModelRunner

    cfg = Config.build({"model": {"path": path},
                        "runtime": {"device": "cpu", "dtype": "float32", "num_threads": 1,
                                    "cpu_matmul_precision": precision},
                        "scheduler": {"max_total_tokens": 2048, "max_running_requests": 8}})
    return ModelRunner(cfg, show_progress=False)


def test_a_model_with_medium_precision_runs_bf16_panels(gemm, tiny_llama_dir):
    from runner_driver import greedy_generate

    path = tiny_llama_dir("llama", head_dim=64, num_attention_heads=4, num_key_value_heads=2, hidden_size=128)
    fp32, medium = _runner(path, "highest"), _runner(path, "medium")
    layer = medium.model.model.layers[0]
    assert all(lin.packed_weight.bf16 for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                   layer.mlp.gate_up_proj, layer.mlp.down_proj))
    head = medium.model.lm_head
    assert head.packed_weight.bf16
    if cpu_gemm.amx_available():  # the logits on AMX tiles (test_cpu_amx_gemm.py), the screen on panels of its own
        assert head.packed_weight.amx is not None and head.packed_weight.panels is None
    else:
        # the greedy screen's bf16 copy (AVX-512) serves the logits too: one copy, the bits to_bf16_panels would give
        assert (head.greedy_head is not None) == (gemm.panel_width() == 48)
        if head.greedy_head is not None:
            assert head.packed_weight.panels is head.greedy_head.panels
            assert head.greedy_head.widen == cpu_gemm.bf16_products_widened()
        assert torch.equal(head.packed_weight.panels, gemm.to_bf16_panels(gemm.pack(head.weight.detach())))
        assert head.packed_weight.widen == cpu_gemm.bf16_products_widened()
    assert not fp32.model.model.layers[0].mlp.gate_up_proj.packed_weight.bf16
    prompts = [[5, 9, 2, 7, 11], [3] * 30, [8, 1]]
    batched = greedy_generate(medium, prompts, 12, keep_logits=True)
    alone = greedy_generate(medium, [prompts[1]], 12, keep_logits=True)[0]  # the batch's way of picking tokens
    assert alone.tokens == batched[1].tokens  # rows do not see each other
    reference = greedy_generate(fp32, prompts, 12, keep_logits=True)
    first_step = (batched[0].logits[0] - reference[0].logits[0]).abs().max().item()
    assert 0 < first_step < 0.05, first_step  # bf16-rounded products: close to fp32, not equal


def test_medium_without_bf16_hardware_warns_and_stays_fp32(monkeypatch, caplog):
    model = torch.nn.Linear(4, 4)
    monkeypatch.setattr(cpu_gemm, "bf16_available", lambda: False)
    with caplog.at_level(logging.WARNING, logger="radixserve.layers.cpu_gemm"):
        assert cpu_gemm.lower_precision(model) == 0
    assert "native CPU GEMM does not run here" in caplog.text and "stay fp32" in caplog.text


def test_the_product_is_logged_only_where_bf16_gemms_run(gemm, tiny_llama_dir, caplog):
    """CPU-deployer audit 35: an fp32 (`highest`) server logged "bf16 panels: vdpbf16ps does 0.49x ..." (its greedy
    screen's choice), which read as bf16 GEMMs in use; under `medium` the line said "run their CPU GEMMs in bf16"
    where the products were fp32 on widened weights."""
    path = tiny_llama_dir("llama", head_dim=64, num_attention_heads=4, num_key_value_heads=2, hidden_size=128)
    with caplog.at_level(logging.INFO):
        _runner(path, "highest")
    assert "vdpbf16ps" not in caplog.text and "bf16" not in caplog.text, caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO):
        _runner(path, "medium")
    line = next(r.getMessage() for r in caplog.records if "cpu_matmul_precision=medium" in r.getMessage())
    widened = cpu_gemm.bf16_products_widened()
    why = "FMA's FLOPs a second on this CPU" if gemm.bf16_dot_available() else "no AVX-512 BF16 (no vdpbf16ps)"
    assert "kept in bf16 for their CPU GEMMs" in line and why in line, line
    assert ("widen the weights to fp32" in line) == widened and ("round the inputs to bf16" in line) != widened, line
