"""runtime.cpu_matmul_precision=medium on a CPU with AMX: the decoder's linears run on AMX tiles
(csrc/amx_gemm.cpp).

What a user relies on: the products are those of the bf16-rounded inputs summed in fp32 (as the bf16
panels' vdpbf16ps product), each row's result is the same bits whatever else is in the batch (so a
request's tokens do not depend on its batch), a gated projection gives silu(gate) * up, and the LM
head keeps its panels. The tile layout and which weights take tiles are checked on every CPU; the
kernel itself only where the CPU has AMX (skipped, and said so, elsewhere: it ran on the AMX Xeon of
session 38)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from radixserve.layers import cpu_gemm


@pytest.fixture(scope="module")
def amx():
    if not cpu_gemm.amx_available():
        pytest.skip("this CPU has no AMX tiles (amx_bf16): medium precision runs bf16 panels here")
    return cpu_gemm._amx_gemm()


def _bf16_product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return (x.bfloat16().double() @ weight.bfloat16().double().T)


def test_the_tiles_hold_each_weight_pair_where_the_kernel_reads_it():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(48, 64, generator=gen)
    tiles = cpu_gemm.amx_tiles(w)
    assert tiles.dtype == torch.int16 and tiles.shape == (3, 2, 16, 16, 2)
    bits = w.bfloat16().view(torch.int16)
    for b, k, p, n, j in [(0, 0, 0, 0, 0), (2, 1, 15, 7, 1), (1, 0, 3, 15, 0), (2, 1, 15, 15, 1)]:
        assert tiles[b, k, p, n, j] == bits[16 * b + n, 32 * k + 2 * p + j]
    # a gated [gate; up] weight: gate block i, then up block i
    gated = cpu_gemm.amx_tiles(torch.randn(64, 32, generator=gen), silu_gated=True)
    assert gated is not None and gated.shape == (4, 1, 16, 16, 2)
    g = torch.randn(64, 32, generator=gen)
    t = cpu_gemm.amx_tiles(g, silu_gated=True)
    order = [0, 2, 1, 3]  # packed block -> block of [gate; up]
    for packed_block, block in enumerate(order):
        assert torch.equal(t[packed_block, 0, 0, :, 0], g[16 * block:16 * block + 16, 0].bfloat16().view(torch.int16))


@pytest.mark.parametrize(("rows", "cols", "gated"), [(50, 64, False), (48, 33, False), (48, 64, True)])
def test_shapes_the_kernel_cannot_take_keep_their_panels(rows, cols, gated):
    """K a multiple of 32, N of 16 (a gated N of 32: each half whole blocks); otherwise no tiles."""
    w = torch.randn(rows, cols)
    assert (cpu_gemm.amx_tiles(w, gated) is None) == (cols % 32 != 0 or rows % (32 if gated else 16) != 0)
    if cols % 32 or rows % 16:
        packed = cpu_gemm.pack(w)
        assert cpu_gemm.to_amx(packed, w) is None


def test_lower_precision_puts_the_linears_and_the_head_on_tiles(tiny_llama_dir):
    """Which weights take tiles, on any CPU (the kernel is not called): every linear of the decoder and
    the LM head, whose greedy screen keeps bf16 panels of its own."""
    if not cpu_gemm.bf16_available():
        pytest.skip("no native GEMM here: nothing is packed, so nothing is lowered")
    from radixserve.config import Config
    from radixserve.model_runner import ModelRunner

    path = tiny_llama_dir("llama", head_dim=64, num_attention_heads=4, num_key_value_heads=2, hidden_size=128)
    cfg = Config.build({"model": {"path": path}, "runtime": {"device": "cpu", "dtype": "float32", "num_threads": 1},
                        "scheduler": {"max_total_tokens": 2048}})
    model = ModelRunner(cfg, show_progress=False).model
    converted = cpu_gemm.lower_precision(model, amx=True)
    layer = model.model.layers[0]
    linears = (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
    assert converted >= 4 * len(model.model.layers) + 1
    for lin in linears:
        packed = lin.packed_weight
        assert packed.bf16 and packed.amx is not None and packed.panels is None, lin
        assert torch.equal(packed.amx, cpu_gemm.amx_tiles(lin.weight, packed.silu_gated))
    head = model.lm_head
    assert head.packed_weight.amx is not None and head.packed_weight.panels is None
    assert torch.equal(head.packed_weight.amx, cpu_gemm.amx_tiles(head.weight))
    if head.greedy_head is not None:  # (AVX-512 builds)
        assert head.greedy_head.panels.dtype == torch.int16


@pytest.mark.parametrize(("out_features", "in_features"), [(960, 576), (576, 1536), (48, 64), (16, 32)])
def test_the_tiles_compute_the_bf16_rounded_product_the_same_for_each_row_alone(amx, out_features, in_features):
    """Every row count up to two 32-row blocks and a remainder (77 rows), an odd number of 16-column
    blocks (48, 16), K of one tile (32): fp32 sums of bf16-rounded inputs, and each row (alone, or in
    another part of the batch) gives the same bits."""
    gen = torch.Generator().manual_seed(out_features + in_features)
    w, x = torch.randn(out_features, in_features, generator=gen) * 0.05, torch.randn(77, in_features, generator=gen)
    packed = cpu_gemm.to_amx(cpu_gemm.pack(w), w)
    bias = torch.randn(out_features, generator=gen)
    got = cpu_gemm.linear(x, w, packed, bias)
    want = _bf16_product(x, w) + bias.double()
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * in_features / 64)
    assert not torch.equal(got, F.linear(x, w, bias))  # not the fp32 product: the inputs are rounded
    for begin, end in [(0, 1), (5, 6), (0, 16), (3, 40), (76, 77), (10, 77)]:
        assert torch.equal(cpu_gemm.linear(x[begin:end], w, packed, bias), got[begin:end]), (begin, end)


def test_a_gated_projection_on_tiles_gives_silu_of_gate_times_up(amx):
    gen = torch.Generator().manual_seed(3)
    width = 1536
    w, x = torch.randn(2 * width, 576, generator=gen) * 0.05, torch.randn(21, 576, generator=gen)
    packed = cpu_gemm.to_amx(cpu_gemm.pack_silu_gated(w), w)
    assert packed.silu_gated and packed.out_features == width
    got = cpu_gemm.silu_gated_linear(x, packed)
    both = _bf16_product(x, w)
    torch.testing.assert_close(got.double(), F.silu(both[:, :width]) * both[:, width:], rtol=1e-5, atol=1e-5)
    assert torch.equal(cpu_gemm.silu_gated_linear(x[4:5], packed), got[4:5])


def test_a_model_on_tiles_keeps_each_requests_tokens_independent_of_its_batch(amx, tiny_llama_dir):
    from radixserve.config import Config
    from radixserve.model_runner import ModelRunner
    from runner_driver import greedy_generate

    path = tiny_llama_dir("llama", head_dim=64, num_attention_heads=4, num_key_value_heads=2, hidden_size=128,
                          intermediate_size=256)
    cfg = Config.build({"model": {"path": path},
                        "runtime": {"device": "cpu", "dtype": "float32", "num_threads": 2, "cpu_matmul_precision": "medium"},
                        "scheduler": {"max_total_tokens": 2048, "max_running_requests": 8}})
    medium = ModelRunner(cfg, show_progress=False)
    assert medium.model.model.layers[0].mlp.gate_up_proj.packed_weight.amx is not None
    prompts = [[5, 9, 2, 7, 11], [3] * 40, [8, 1], list(range(20, 60))]
    batched = greedy_generate(medium, prompts, 12, keep_logits=True)
    for i in (1, 3):
        alone = greedy_generate(medium, [prompts[i]], 12, keep_logits=True)[0]
        assert alone.tokens == batched[i].tokens
        assert all(torch.equal(a, b) for a, b in zip(alone.logits, batched[i].logits, strict=True))


def test_lower_precision_puts_routed_experts_on_tiles(tmp_path):
    """Each expert's [gate; up] and down weights take tiles too, on any CPU (the kernel is not called)."""
    if not cpu_gemm.bf16_available():
        pytest.skip("no native GEMM here: nothing is packed, so nothing is lowered")
    from family_cases import MOE_CASES
    from radixserve.config import Config
    from radixserve.model_runner import ModelRunner
    from radixserve.testing import tiny_checkpoint

    model_type, overrides = MOE_CASES["Qwen2MoeForCausalLM"]
    path = tiny_checkpoint(model_type, str(tmp_path), **overrides)
    cfg = Config.build({"model": {"path": path}, "runtime": {"device": "cpu", "dtype": "float32", "num_threads": 1},
                        "scheduler": {"max_total_tokens": 1024}})
    model = ModelRunner(cfg, show_progress=False).model
    cpu_gemm.lower_precision(model, amx=True)
    moe = next(m for m in model.modules() if getattr(m, "packed_experts", None))
    gate_up, down = moe.packed_experts
    for e, (p13, p2) in enumerate(zip(gate_up, down, strict=True)):
        assert p13.silu_gated and torch.equal(p13.amx, cpu_gemm.amx_tiles(moe.w13_weight[e], silu_gated=True))
        assert torch.equal(p2.amx, cpu_gemm.amx_tiles(moe.w2_weight[e]))
