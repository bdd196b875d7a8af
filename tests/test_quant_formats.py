"""AWQ, GPTQ and fp8 quantization plugins on the CPU: their unpacking against each format's
reference dequantization (tests/quant_fixtures.py), the QuantMethod conformance kit, greedy
fidelity of tiny quantized checkpoints against transformers on the dequantized weights, and the
start-up errors a user sees for a config the method cannot serve."""

from __future__ import annotations

import pytest
import torch
from radixserve.layers.linear import ReplicatedLinear
from radixserve.layers.quant_int4 import pack_int4, unpack_int4
from radixserve.testing import check_model_parity, check_quant_method, check_quant_method_moe, tiny_checkpoint
from radixserve_models_llama.model import LlamaForCausalLM
from radixserve_quant_awq.method import AWQ_ORDER, AWQMethod
from radixserve_quant_fp8.method import FP8Method
from radixserve_quant_gptq.method import GPTQMethod

from tests import quant_fixtures as qf


def _load_linear(method, tensors: dict[str, torch.Tensor], in_features: int, out_features: int) -> ReplicatedLinear:
    layer = ReplicatedLinear(in_features, out_features, False, method)
    params = dict(layer.named_parameters())
    for name, t in tensors.items():
        params[name].weight_loader(params[name], t)
    method.process_weights_after_loading(layer)
    return layer


# ---- packing and unpacking ---------------------------------------------------------------------
@pytest.mark.parametrize("order", [tuple(range(8)), AWQ_ORDER])
@pytest.mark.parametrize("dim", [0, 1])
def test_int4_pack_round_trip(order, dim):
    codes = torch.randint(0, 16, (16, 24), generator=torch.Generator().manual_seed(1))
    packed = pack_int4(codes, dim, order)
    assert packed.dtype == torch.int32 and packed.shape[dim] == codes.shape[dim] // 8
    assert torch.equal(unpack_int4(packed, dim, order), codes.int())


def test_awq_packing_matches_the_reference_packer():
    codes = torch.randint(0, 16, (8, 32), generator=torch.Generator().manual_seed(2))
    assert torch.equal(pack_int4(codes, 1, AWQ_ORDER), qf.awq_pack_cols(codes))
    assert torch.equal(unpack_int4(qf.awq_pack_cols(codes), 1, AWQ_ORDER), codes.int())


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_awq_dequantization_is_bit_exact(group_size):
    w = torch.randn(48, 256, generator=torch.Generator().manual_seed(3))
    tensors, _ = qf.awq_quantize(w, group_size)
    ref = qf.awq_reference_dequant(tensors["qweight"], tensors["qzeros"], tensors["scales"], group_size)
    layer = _load_linear(AWQMethod(group_size), tensors, 256, 48)
    assert torch.equal(layer.int4_weight.dequantize(torch.float32), ref)


@pytest.mark.parametrize("group_size,sym,act_order", [(32, False, False), (64, True, False), (128, False, True),
                                                      (32, True, True), (-1, False, False)])
def test_gptq_dequantization_is_bit_exact(group_size, sym, act_order):
    w = torch.randn(40, 256, generator=torch.Generator().manual_seed(4))
    tensors, _ = qf.gptq_quantize(w, group_size, sym=sym, act_order=act_order)
    ref = qf.gptq_reference_dequant(tensors["qweight"], tensors["qzeros"], tensors["scales"], tensors["g_idx"])
    layer = _load_linear(GPTQMethod(group_size, desc_act=act_order), tensors, 256, 40)
    iw = layer.int4_weight
    got = iw.dequantize(torch.float32)
    if act_order:  # kernel rows are sorted by group; undo it to compare with the file's row order
        assert iw.perm is not None and bool((iw.g_idx[1:] >= iw.g_idx[:-1]).all())
        got = torch.empty_like(got).index_copy_(0, iw.perm, got)
    assert torch.equal(got, ref)
    x = torch.randn(3, 256)
    torch.testing.assert_close(layer(x), x @ ref, rtol=1e-4, atol=1e-4)


def test_gptq_v2_zero_points_have_no_offset():
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(5))
    tensors, deq = qf.gptq_quantize(w, 32)
    v2 = dict(tensors, qzeros=qf.gptq_pack_zeros(unpack_int4(tensors["qzeros"], 1) + 1))  # v2 stores the zero itself
    method = GPTQMethod.from_config({"quant_method": "gptq", "bits": 4, "group_size": 32, "checkpoint_format": "gptq_v2"})
    layer = _load_linear(method, v2, 64, 16)
    torch.testing.assert_close(layer.int4_weight.dequantize(), deq.T, rtol=0, atol=0)


@pytest.mark.parametrize("mode", ["block", "tensor"])
def test_fp8_dequantization(mode):
    w = torch.randn(256, 128, generator=torch.Generator().manual_seed(6))
    if mode == "block":
        tensors, deq = qf.fp8_block_quantize(w)
        method = FP8Method.from_config(qf.QUANT_CONFIGS["fp8_block"]())
    else:
        tensors, deq = qf.fp8_tensor_quantize(w)
        method = FP8Method.from_config(qf.QUANT_CONFIGS["fp8_tensor"]())
    layer = _load_linear(method, tensors, 128, 256)
    assert torch.equal(method.dequantized_weight(layer), deq)
    x = torch.randn(4, 128)
    torch.testing.assert_close(layer(x), x @ deq.T, rtol=1e-5, atol=1e-5)


def test_fp8_online_quantization_is_per_channel():
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(7)) * torch.linspace(0.01, 10, 64)[:, None]
    method = FP8Method.from_config(None)
    layer = _load_linear(method, {"weight": w}, 128, 64)
    assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight_scale_rows.shape == (64,)
    err = (method.dequantized_weight(layer) - w).abs().amax(1) / w.abs().amax(1)
    assert float(err.max()) < 0.07  # e4m3 keeps 3 mantissa bits: <= 1/16 relative per element
    method.process_weights_after_loading(layer)  # idempotent: not quantized twice
    assert layer.weight.dtype == torch.float8_e4m3fn


# ---- the conformance kit -------------------------------------------------------------------------
@pytest.mark.parametrize("group_size", [32, 64])
def test_awq_conformance(group_size):
    check_quant_method(lambda: AWQMethod(group_size), lambda w: qf.awq_quantize(w, group_size), unit=64)


def test_int4_bf16_layers_keep_fp16_scales_exact():
    """bf16 models: the checkpoint's fp16 scales stay fp16 (bf16 would round them)."""
    check_quant_method(lambda: AWQMethod(32), lambda w: qf.awq_quantize(w, 32), unit=64, dtype=torch.bfloat16)
    layer = ReplicatedLinear(64, 16, False, GPTQMethod(32), params_dtype=torch.bfloat16)
    assert layer.scales.dtype == torch.float16


@pytest.mark.parametrize("sym,act_order", [(False, False), (True, True)])
def test_gptq_conformance(sym, act_order):
    check_quant_method(lambda: GPTQMethod(32, desc_act=act_order),
                       lambda w: qf.gptq_quantize(w, 32, sym=sym, act_order=act_order), unit=32)


def test_fp8_conformance():
    check_quant_method(lambda: FP8Method.from_config(qf.QUANT_CONFIGS["fp8_block"]()), qf.fp8_block_quantize, unit=256)
    check_quant_method(lambda: FP8Method.from_config(qf.QUANT_CONFIGS["fp8_tensor"]()), qf.fp8_tensor_quantize)


def test_fp8_block_moe_conformance():
    """Block-FP8 routed experts (DeepSeek-V3 layout) against their dequantized reference."""
    check_quant_method_moe(lambda: FP8Method.from_config(qf.QUANT_CONFIGS["fp8_block"]()), qf.fp8_block_quantize,
                           unit=128)


# ---- greedy fidelity on tiny checkpoints ---------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return tiny_checkpoint("llama", str(tmp_path_factory.mktemp("llama")), tie_word_embeddings=False,
                           **qf.TINY_QUANT_CONFIG)


@pytest.mark.parametrize("fmt,group_size,opts", [
    ("awq", 32, {}),
    ("awq", 128, {}),
    ("gptq", 64, {"sym": True}),
    ("gptq", 32, {"act_order": True}),
    ("fp8_block", 128, {}),
    ("fp8_tensor", 0, {}),
])
def test_greedy_fidelity_against_dequantized_weights(tiny_llama, tmp_path, fmt, group_size, opts):
    from radixserve.model_loader.quant_select import checkpoint_quant_config
    from transformers import AutoConfig

    quant, ref = str(tmp_path / "quant"), str(tmp_path / "ref")
    qf.write_quantized_checkpoint(tiny_llama, quant, ref, fmt, group_size, **opts)
    qc = checkpoint_quant_config(AutoConfig.from_pretrained(quant))
    method = {"awq": AWQMethod, "gptq": GPTQMethod, "fp8": FP8Method}[qc["quant_method"]].from_config(qc)
    check_model_parity(LlamaForCausalLM, quant, quant_method=method, reference=ref, prompt_lens=(5, 9),
                       new_tokens=6)


# ---- configuration errors ------------------------------------------------------------------------
@pytest.mark.parametrize("method,config,needle", [
    (AWQMethod, {"quant_method": "awq", "bits": 3, "group_size": 128}, "bits=3"),
    (AWQMethod, {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "gemv"),
    (AWQMethod, {"quant_method": "awq", "bits": 4, "group_size": 96}, "group_size=96"),
    (AWQMethod, None, "cannot quantize a float checkpoint"),
    (GPTQMethod, {"quant_method": "gptq", "bits": 8, "group_size": 128}, "bits=8"),
    (GPTQMethod, {"quant_method": "gptq", "bits": 4, "group_size": 128, "lm_head": True}, "lm_head"),
    (GPTQMethod, {"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"}, "marlin"),
    (FP8Method, {"quant_method": "fp8", "weight_block_size": [64, 64]}, "[64, 64]"),
    (FP8Method, {"quant_method": "fp8", "fmt": "e5m2"}, "e5m2"),
])
def test_unsupported_configs_are_named(method, config, needle):
    with pytest.raises(ValueError, match=None) as e:
        method.from_config(config)
    assert needle in str(e.value)


@pytest.mark.parametrize("tokens", [1, 6], ids=["per-pair (decode)", "all-experts (prefill)"])
def test_fp8_block_experts_match_the_dequantized_reference(tokens):
    """Block-FP8 routed experts: both compute paths equal the reference MoE on the dequantized
    weights (1 token x top-2 < 4 experts dequantizes only the routed pairs; 6 tokens all experts)."""
    from radixserve.layers.moe.reference import fused_experts_reference
    from radixserve_quant_fp8 import kernels, moe

    gen = torch.Generator().manual_seed(0)
    e, h, i, block = 4, 256, 128, (128, 128)
    layer = torch.nn.Module()
    layer.weight_loader = None
    moe.create_block_fp8_moe_weights(layer, e, h, i, block)
    for name in ("w13", "w2"):
        w = getattr(layer, f"{name}_weight")
        w.data.copy_((torch.randn(w.shape, generator=gen) * 0.5).to(torch.float8_e4m3fn))
        s = getattr(layer, f"{name}_weight_scale_inv")
        s.data.copy_(torch.rand(s.shape, generator=gen) * 0.1 + 0.01)
    x = torch.randn(tokens, h, generator=gen)
    ids = torch.stack([torch.randperm(e, generator=gen)[:2] for _ in range(tokens)])
    weights = torch.rand(tokens, 2, generator=gen)
    got = moe.apply_block_fp8_moe(layer, x, weights, ids, block)
    w13 = kernels.dequantize_blocks(layer.w13_weight, layer.w13_weight_scale_inv, block, torch.float32)
    w2 = kernels.dequantize_blocks(layer.w2_weight, layer.w2_weight_scale_inv, block, torch.float32)
    torch.testing.assert_close(got, fused_experts_reference(x, w13, w2, weights, ids), rtol=1e-4, atol=1e-3)
