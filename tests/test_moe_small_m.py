"""The small-batch fused-MoE path (radixserve.layers.moe.small_m) under TRITON_INTERPRET=1: the GEMV
kernels and the fused router against the plain reference, the split down projection, batch
invariance, and the layer choosing the small path only for few (token, expert) pairs."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from radixserve.layers import triton_support
from radixserve.layers.moe import FusedMoE, RoutingConfig, select_experts, small_m, triton_kernel
from radixserve.layers.moe.reference import fused_experts_reference
from radixserve.layers.triton_support import interpreting

# Every test here hands the kernels CPU tensors, which only the interpreter runs (tests/conftest.py sets it on a
# machine without a GPU: CI). On a GPU machine the same kernels are checked on CUDA tensors by
# benchmarks/h200/qwen_b1_kernels.py and qwen_b1_parity.py (session 23 ran this file there: CPU tensors reach the launcher).
pytestmark = pytest.mark.skipif(not interpreting(), reason="CPU tensors through the Triton interpreter (TRITON_INTERPRET "
                                "is set only without a GPU); on CUDA see benchmarks/h200/qwen_b1_kernels.py")

ROUTINGS = {
    "softmax-renorm": RoutingConfig(top_k=2, scoring="softmax", renormalize=True),
    "softmax-raw": RoutingConfig(top_k=3, scoring="softmax", renormalize=False),
    "sigmoid-renorm": RoutingConfig(top_k=2, scoring="sigmoid", renormalize=True),
    "sigmoid-raw-scaled": RoutingConfig(top_k=2, scoring="sigmoid", renormalize=False, routed_scaling_factor=2.5),
}
E, H, INTER = 32, 24, 16  # 32 experts: up to 16 pairs take the small path (one per two experts)


def _layer(cfg: RoutingConfig, dtype=torch.float32, seed=0, correction_bias=False) -> FusedMoE:
    layer = FusedMoE(E, H, INTER, cfg, prefix="model.layers.0.mlp.experts", params_dtype=dtype,
                     correction_bias=correction_bias)
    gen = torch.Generator().manual_seed(seed)
    layer.w13_weight.data.copy_(torch.randn(E, 2 * INTER, H, generator=gen) * 0.2)
    layer.w2_weight.data.copy_(torch.randn(E, H, INTER, generator=gen) * 0.2)
    return layer


@pytest.fixture
def as_if_on_cuda(monkeypatch):
    """The layer's Triton routes taken with CPU tensors (run by the interpreter); records which
    expert path each call took."""
    taken = []
    monkeypatch.setattr(small_m, "available", lambda t: True)
    monkeypatch.setattr(triton_kernel, "available", lambda t: True)
    real_small, real_align = small_m.small_m_fused_experts, triton_kernel.align_pairs_by_expert

    def small(*args, **kwargs):
        taken.append("small")
        return real_small(*args, **kwargs)

    def grouped(*args, **kwargs):
        taken.append("grouped")
        return real_align(*args, **kwargs)

    monkeypatch.setattr(small_m, "small_m_fused_experts", small)
    monkeypatch.setattr(triton_kernel, "align_pairs_by_expert", grouped)
    return taken


@pytest.mark.parametrize("case", sorted(ROUTINGS))
def test_layer_small_path_matches_reference_for_one_to_four_tokens(case, as_if_on_cuda):
    cfg = ROUTINGS[case]
    layer = _layer(cfg)
    gen = torch.Generator().manual_seed(7)
    for m in (1, 2, 3, 4):
        x = torch.randn(m, H, generator=gen)
        logits = torch.randn(m, E, generator=gen) * 2
        weights, ids = select_experts(logits, cfg)
        got_w, got_ids = small_m.fused_select_experts(logits, cfg)
        assert torch.equal(got_ids, ids) and got_ids.dtype == torch.int32
        torch.testing.assert_close(got_w, weights, atol=1e-6, rtol=1e-5)
        got = layer(x, logits)
        want = fused_experts_reference(x, layer.w13_weight, layer.w2_weight, weights, ids)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert as_if_on_cuda == ["small"] * 4


def test_small_path_bf16_and_split_down_projection():
    """bf16 weights and activations, and the down projection's reduction split in 3 parts (I = 520
    is three 256-wide blocks) and summed per token in a fixed order."""
    gen = torch.Generator().manual_seed(1)
    e, h, i = 4, 16, 520
    w13 = (torch.randn(e, 2 * i, h, generator=gen) * 0.2).to(torch.bfloat16)
    w2 = (torch.randn(e, h, i, generator=gen) * 0.2).to(torch.bfloat16)
    x = torch.randn(1, h, generator=gen).to(torch.bfloat16)
    weights, ids = select_experts(torch.randn(1, e, generator=gen), RoutingConfig(top_k=2))
    got = small_m.small_m_fused_experts(x, w13, w2, weights, ids, splits=3)
    assert got.dtype == torch.bfloat16 and got.shape == (1, h)
    torch.testing.assert_close(got, fused_experts_reference(x, w13, w2, weights, ids), atol=3e-2, rtol=3e-2)


def test_down_projection_sums_the_rows_in_its_last_program():
    """With `SmallMBlocks.fused_sum` (the default) the last program of each (token, column block) sums the token's top_k * splits
    partial rows itself (no `sum_rows` launch): the same bits as the separate launch, for several
    tokens and a split reduction, and the arrival counters are all zero again afterwards."""
    gen = torch.Generator().manual_seed(9)
    # 40: a partial last column block of 16; I = 96: three 32-wide splits; K steps that divide H and
    # the splits (the kernels' unmasked EVEN_K loads; the other tests take the masked ones)
    e, h, i = 8, 40, 96
    blocks = small_m.SmallMBlocks(gate_up_n=16, gate_up_k=8, down_n=16, down_k=32)
    w13 = torch.randn(e, 2 * i, h, generator=gen) * 0.2
    w2 = torch.randn(e, h, i, generator=gen) * 0.2
    x = torch.randn(3, h, generator=gen)
    weights, ids = select_experts(torch.randn(3, e, generator=gen), RoutingConfig(top_k=2))
    outs = {}
    for fused in (True, False):
        outs[fused] = small_m.small_m_fused_experts(x, w13, w2, weights, ids, splits=3,
                                                    blocks=dataclasses.replace(blocks, fused_sum=fused))
    assert torch.equal(outs[True], outs[False])
    torch.testing.assert_close(outs[True], fused_experts_reference(x, w13, w2, weights, ids), atol=1e-4, rtol=1e-4)
    assert not any(buf.any() for buf in small_m._ARRIVALS[x.device])


def test_small_path_is_batch_invariant():
    """A token's output is bit-identical alone and among other tokens (no atomics, no split that
    depends on the batch)."""
    layer = _layer(RoutingConfig(top_k=2))
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(3, H, generator=gen)
    weights, ids = select_experts(torch.randn(3, E, generator=gen), layer.routing)
    args = (layer.w13_weight, layer.w2_weight)
    batched = small_m.small_m_fused_experts(x, *args, weights, ids)
    alone = small_m.small_m_fused_experts(x[1:2], *args, weights[1:2], ids[1:2])
    assert torch.equal(batched[1:2], alone)


def test_fused_router_with_correction_bias():
    cfg = RoutingConfig(top_k=3, scoring="sigmoid", renormalize=True, routed_scaling_factor=2.5)
    gen = torch.Generator().manual_seed(5)
    logits, bias = torch.randn(4, 16, generator=gen), torch.randn(16, generator=gen)
    weights, ids = select_experts(logits, cfg, bias)
    got_w, got_ids = small_m.fused_select_experts(logits, cfg, bias)
    assert torch.equal(got_ids, ids)
    torch.testing.assert_close(got_w, weights, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("case", ["softmax-renorm", "sigmoid-raw-scaled"])
def test_one_launch_router_computes_the_gate_and_routes(case, as_if_on_cuda):
    """`FusedMoE.forward_with_gate`: the router's linear and its top-k in one kernel (the last program
    of each token routes it) give the ids and weights of the linear layer + `select_experts`, the
    layer output of `layer(x, gate(x))`, and leave the arrival counters at zero for the next launch;
    1 and 3 tokens, 33 experts (the last program holds a partial block of rows), a correction bias."""
    from radixserve.layers.linear import ReplicatedLinear

    cfg = ROUTINGS[case]
    e = 33
    torch.manual_seed(11)
    layer = FusedMoE(e, H, INTER, cfg, correction_bias=True)
    layer.w13_weight.data.normal_(0, 0.2), layer.w2_weight.data.normal_(0, 0.2)
    layer.e_score_correction_bias.data.normal_(0, 0.1)
    gate = ReplicatedLinear(H, e)
    gate.weight.data.normal_(0, 0.5)
    for m in (1, 3):
        x = torch.randn(m, H)
        logits = gate(x)
        weights, ids = select_experts(logits, cfg, layer.e_score_correction_bias)
        assert small_m.fused_gate_applies(x, gate.weight, cfg, layer._gate_arrivals)
        got_w, got_ids = small_m.fused_gate_select_experts(x, gate.weight, cfg, layer._gate_arrivals,
                                                           layer.e_score_correction_bias)
        assert torch.equal(got_ids, ids) and got_ids.dtype == torch.int32
        torch.testing.assert_close(got_w, weights, atol=1e-5, rtol=1e-4)
        assert not layer._gate_arrivals.any()
        torch.testing.assert_close(layer.forward_with_gate(x, gate), layer(x, logits), atol=1e-5, rtol=1e-5)
    assert as_if_on_cuda == ["small"] * 4
    # a gate with a bias, or more pairs than the small path takes: the linear layer, then the router
    assert not small_m.fused_gate_applies(torch.randn(17, H), gate.weight, cfg, layer._gate_arrivals)
    biased = ReplicatedLinear(H, e, bias=True)
    biased.weight.data.copy_(gate.weight), biased.bias.data.normal_(0, 1.0)
    x = torch.randn(1, H)
    torch.testing.assert_close(layer.forward_with_gate(x, biased), layer(x, biased(x)), atol=0, rtol=0)


def test_layer_takes_the_small_path_only_for_few_pairs(as_if_on_cuda, monkeypatch):
    assert small_m.use_small_m(64, 128) and not small_m.use_small_m(65, 128) and not small_m.use_small_m(0, 128)
    assert small_m.use_small_m(4, 8) and not small_m.use_small_m(5, 8)  # at most one pair per two experts
    monkeypatch.setattr(small_m, "SMALL_M_MAX_PAIRS", 4)
    cfg = RoutingConfig(top_k=2)
    layer = _layer(cfg)
    for m in (1, 2, 3):  # 2, 4, 6 pairs
        x, logits = torch.randn(m, H), torch.randn(m, E)
        want = fused_experts_reference(x, layer.w13_weight, layer.w2_weight, *select_experts(logits, cfg))
        torch.testing.assert_close(layer(x, logits), want, atol=1e-4, rtol=1e-4)
    assert as_if_on_cuda == ["small", "small", "grouped"]
    grouped = RoutingConfig(top_k=2, num_expert_group=4, topk_group=2)
    assert not small_m.fused_router_applies(torch.randn(1, 8), grouped)  # expert groups: the torch router


def test_path_argument_is_checked():
    w13, w2 = torch.zeros(2, 8, 4), torch.zeros(2, 4, 4)
    with pytest.raises(ValueError, match="'fast'"):
        triton_kernel.triton_fused_experts(torch.zeros(1, 4), w13, w2, torch.ones(1, 1),
                                           torch.zeros(1, 1, dtype=torch.int32), path="fast")


def test_one_launch_experts_equal_the_two_launches():
    """`SmallMBlocks(one_launch=True)`: gate_up and down tiles in one grid, ordered by tickets, give
    the two-launch result bit for bit (same tiles, same sums): 2 tokens with unmasked K steps and a
    split down projection, then 1 token with masked K steps (H = 36, I = 48 in two splits, the
    second partial); the counters are all zero after each call (the second call reuses them)."""
    gen = torch.Generator().manual_seed(13)
    e, top_k = 8, 2
    for m, h, i, splits, gu_k in ((2, 32, 64, 2, 16), (1, 36, 48, 2, 32)):
        two = small_m.SmallMBlocks(gate_up_n=32, gate_up_k=gu_k, down_n=16, down_k=32, one_launch=False)
        one = small_m.SmallMBlocks(**{**two.__dict__, "one_launch": True})
        w13 = torch.randn(e, 2 * i, h, generator=gen) * 0.2
        w2 = torch.randn(e, h, i, generator=gen) * 0.2
        x = torch.randn(m, h, generator=gen)
        weights, ids = select_experts(torch.randn(m, e, generator=gen), RoutingConfig(top_k=top_k))
        want = small_m.small_m_fused_experts(x, w13, w2, weights, ids, splits=splits, blocks=two)
        got = small_m.small_m_fused_experts(x, w13, w2, weights, ids, splits=splits, blocks=one)
        assert torch.equal(got, want)
        assert not any(buf.any() for buf in small_m._ARRIVALS[x.device])
        torch.testing.assert_close(got, fused_experts_reference(x, w13, w2, weights, ids), atol=1e-4, rtol=1e-4)


def test_one_launch_is_taken_for_at_most_two_tokens(monkeypatch):
    """The default blocks (`one_launch=None`) run the experts in one launch for 1-2 tokens (measured
    faster on the H200) and in two past that (measured slower in one)."""
    from radixserve.layers.moe import one_launch

    taken = []
    monkeypatch.setattr(one_launch, "one_launch_fused_experts", lambda x, *a: taken.append(x.shape[0]) or x)
    e, h, i = 4, 8, 8
    w13, w2 = torch.zeros(e, 2 * i, h), torch.zeros(e, h, i)
    for m in (1, 2, 3):
        ids = torch.zeros(m, 1, dtype=torch.int32)
        small_m.small_m_fused_experts(torch.zeros(m, h), w13, w2, torch.ones(m, 1), ids)
    assert taken == [1, 2] and small_m.ONE_LAUNCH_MAX_TOKENS == 2


def test_post_attention_norm_runs_in_the_router_launch(as_if_on_cuda, monkeypatch):
    """`QwenSparseMoeBlock.forward_norm_fused` (through `FusedMoE.forward_with_norm_gate`): the
    residual add + RMSNorm inside the one-launch router gives the norm's (x, h + residual) and the
    router's ids on x; H = 40 with 32-wide K steps (a masked tail in both passes), 2 tokens. The
    decoder layer takes it (the output of the norm + `forward`), and falls back to those where it
    does not apply. fp32: the interpreter does not round bf16 as the GPU does
    (benchmarks/h200/qwen_b1_kernels.py checks bf16 on the GPU)."""
    from types import SimpleNamespace

    from radixserve.layers.decoder_blocks import PreNormDecoderLayer
    from radixserve.layers.norm import RMSNorm
    from radixserve_models_qwen_moe.model import QwenSparseMoeBlock

    h_size = 40
    config = SimpleNamespace(hidden_size=h_size, num_experts=16, num_experts_per_tok=2, moe_intermediate_size=16,
                             norm_topk_prob=True)
    torch.manual_seed(21)
    block = QwenSparseMoeBlock(config, None, "model.layers.0.mlp")
    for p in block.parameters():
        p.data.normal_(0, 0.3)
    norm = RMSNorm(h_size, 1e-6)
    norm.weight.data.normal_(1, 0.1)
    h, residual = torch.randn(2, h_size), torch.randn(2, h_size)
    want_x, want_res = RMSNorm.forward(norm, h, residual)
    x, res, _, ids = small_m.fused_norm_gate_select_experts(h, residual, norm.weight, norm.eps, block.gate.weight,
                                                            block.experts.routing, block.experts._gate_arrivals)
    assert torch.equal(res, want_res)
    torch.testing.assert_close(x, want_x, atol=1e-6, rtol=1e-6)
    assert torch.equal(ids, select_experts(block.gate(want_x), block.experts.routing)[1])
    assert not block.experts._gate_arrivals.any()
    fused_calls = []
    real = small_m.fused_norm_gate_select_experts
    monkeypatch.setattr(small_m, "fused_norm_gate_select_experts", lambda *a: fused_calls.append(1) or real(*a))

    class Attn(torch.nn.Module):
        def forward(self, positions, x, batch):
            return x * 2

    layer = PreNormDecoderLayer(Attn(), block, RMSNorm(h_size), norm)
    fused_out, fused_res = layer(None, h, residual, None)
    assert fused_calls == [1]  # the layer took the block's fused norm
    monkeypatch.setattr(small_m, "fused_gate_applies", lambda *a: False)  # not fused: the norm, then the block
    assert block.forward_norm_fused(h, residual, norm) is None
    plain_out, plain_res = layer(None, h, residual, None)
    assert fused_calls == [1] and torch.equal(fused_res, plain_res)
    torch.testing.assert_close(fused_out, plain_out, atol=1e-5, rtol=1e-5)


# --- the fused router's top-k (`small_m_steps.route_token`: one `tl.topk` over (choice, index) keys) ---

triton = pytest.importorskip("triton")
tl = triton.language
from radixserve.layers.moe.small_m_steps import routing_scores, store_routing  # noqa: E402 - after the Triton check


@triton.jit
def _argmax_rounds_router(logits_ptr, bias_ptr, weights_ptr, ids_ptr, E, scale, TOP_K: tl.constexpr,
                          SIGMOID: tl.constexpr, RENORMALIZE: tl.constexpr, HAS_BIAS: tl.constexpr,
                          BLOCK_E: tl.constexpr, BLOCK_TOPK: tl.constexpr):
    """The reference: `route_token` as it was before `tl.topk`, TOP_K rounds of argmax (the first index
    on ties), each masking out its pick; the same scores, gathers and renormalising sum (the shared
    `routing_scores` / `store_routing` steps: what differs is the selection)."""
    t = tl.program_id(0)
    offs = tl.arange(0, BLOCK_E)
    ok = offs < E
    logits = tl.load(logits_ptr + t * E + offs, mask=ok, other=float("-inf")).to(tl.float32)
    scores, choice = routing_scores(logits, offs, ok, bias_ptr, SIGMOID, HAS_BIAS)
    choice = tl.where(ok, choice, float("-inf"))
    slots = tl.arange(0, BLOCK_TOPK)
    chosen_ids = tl.zeros((BLOCK_TOPK,), dtype=tl.int32)
    chosen_w = tl.zeros((BLOCK_TOPK,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        best = tl.minimum(tl.argmax(choice, axis=0), E - 1)
        w = tl.sum(tl.where(offs == best, scores, 0.0), axis=0)
        chosen_ids = tl.where(slots == j, best.to(tl.int32), chosen_ids)
        chosen_w = tl.where(slots == j, w, chosen_w)
        choice = tl.where(offs == best, float("-inf"), choice)
    store_routing(chosen_w, chosen_ids, slots, t, weights_ptr, ids_ptr, scale, TOP_K, RENORMALIZE)


def _argmax_rounds(logits: torch.Tensor, cfg: RoutingConfig, bias: torch.Tensor | None = None):
    t, e = logits.shape
    weights = torch.empty((t, cfg.top_k), dtype=torch.float32)
    ids = torch.empty((t, cfg.top_k), dtype=torch.int32)
    _argmax_rounds_router[(t,)](logits.contiguous(), bias if bias is not None else weights, weights, ids, e,
                                float(cfg.routed_scaling_factor), TOP_K=cfg.top_k, SIGMOID=cfg.scoring == "sigmoid",
                                RENORMALIZE=cfg.renormalize, HAS_BIAS=bias is not None,
                                BLOCK_E=small_m._pow2(e), BLOCK_TOPK=small_m._pow2(cfg.top_k), num_warps=1)
    return weights, ids


def _first_index_top_k(choice: torch.Tensor, k: int) -> torch.Tensor:
    """The top k of each row, descending, ties to the lower index (a stable sort)."""
    return torch.sort(choice, dim=-1, descending=True, stable=True).indices[:, :k].to(torch.int32)


TOP_K_CASES = {  # (experts, routing, correction bias)
    "128-top8-softmax": (128, RoutingConfig(top_k=8), False),
    "256-top8-sigmoid-bias-scaled": (256, RoutingConfig(top_k=8, scoring="sigmoid", routed_scaling_factor=2.5), True),
    "60-top4-softmax-raw": (60, RoutingConfig(top_k=4, renormalize=False), False),
    "64-top6-sigmoid-bias": (64, RoutingConfig(top_k=6, scoring="sigmoid"), True),
    "33-top1-softmax-bias": (33, RoutingConfig(top_k=1), True),
}


@pytest.mark.parametrize("case", sorted(TOP_K_CASES))
def test_fused_router_top_k_is_the_argmax_rounds_bit_for_bit(case):
    """The ids and the weights' bits of the argmax rounds the kernel ran before (E a power of two or
    not, top 1 to 8, BLOCK_TOPK above top_k, softmax or sigmoid, a correction bias, scaling): random
    rows, rows of many exact ties (logits rounded to halves), a constant row and a row with -inf
    logits; the ids of `select_experts` on the tie-free random rows."""
    e, cfg, with_bias = TOP_K_CASES[case]
    gen = torch.Generator().manual_seed(e + cfg.top_k)
    bias = torch.randn(e, generator=gen) * 0.1 if with_bias else None
    random = torch.randn(4, e, generator=gen) * 2
    ties = torch.round(torch.randn(3, e, generator=gen) * 2) / 2
    special = torch.zeros(2, e)
    special[1, ::3] = float("-inf")
    logits = torch.cat([random, ties, special])
    got_w, got_ids = small_m.fused_select_experts(logits, cfg, bias)
    want_w, want_ids = _argmax_rounds(logits, cfg, bias)
    assert torch.equal(got_ids, want_ids)
    assert torch.equal(got_w.view(torch.int32), want_w.view(torch.int32))  # bits, signed zeros included
    torch_w, torch_ids = select_experts(random, cfg, bias)
    assert torch.equal(got_ids[:4], torch_ids)
    torch.testing.assert_close(got_w[:4], torch_w, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
def test_fused_router_breaks_ties_by_the_lowest_index(scoring):
    """Equal choices go to the lower expert id first, in every slot: logits from a few values
    (each repeated across the row), a constant row, and a correction bias that only ties pairs."""
    cfg = RoutingConfig(top_k=8, scoring=scoring)
    e = 60  # BLOCK_E 64: four padding lanes, never chosen
    gen = torch.Generator().manual_seed(17)
    logits = torch.randint(0, 4, (3, e), generator=gen).float()
    logits[2] = 1.0
    for bias in (None, torch.arange(e).div(2, rounding_mode="floor").float() * 0.25):
        _, ids = small_m.fused_select_experts(logits, cfg, bias)
        scores = logits.softmax(-1) if scoring == "softmax" else logits.sigmoid()
        choice = scores if bias is None else scores + bias
        assert torch.equal(ids, _first_index_top_k(choice, cfg.top_k))
    assert small_m.fused_select_experts(logits[2:], cfg)[1].tolist() == [list(range(8))]


def test_one_launch_router_breaks_ties_by_the_lowest_index():
    """The gate's last program routes with the same rule: gate rows equal in pairs (exact integer
    sums, so the pairs' logits tie) give the lower expert of each pair first."""
    cfg = RoutingConfig(top_k=4)
    e, h = 16, 24
    gen = torch.Generator().manual_seed(19)
    gate_w = torch.randint(-2, 3, (e // 2, h), generator=gen).float().repeat_interleave(2, dim=0)
    x = torch.randint(-2, 3, (2, h), generator=gen).float()
    arrivals = torch.zeros(4, dtype=torch.int32)
    _, ids = small_m.fused_gate_select_experts(x, gate_w, cfg, arrivals)
    assert torch.equal(ids, _first_index_top_k(x @ gate_w.t(), cfg.top_k))
    assert not arrivals.any()


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
def test_fused_router_orders_negative_choices_and_skips_padding_lanes(scoring):
    """A correction bias below -1 makes every choice negative (the key's sign handling) while the
    padding lanes past E = 60 hold -inf (never chosen, also against -inf choices): the ids of
    `select_experts` and the argmax rounds' bits."""
    cfg = RoutingConfig(top_k=4, scoring=scoring)
    e = 60
    gen = torch.Generator().manual_seed(31)
    logits = torch.randn(3, e, generator=gen) * 2
    bias = -1.5 - torch.rand(e, generator=gen)
    got_w, got_ids = small_m.fused_select_experts(logits, cfg, bias)
    assert torch.equal(got_ids, select_experts(logits, cfg, bias)[1])
    want_w, want_ids = _argmax_rounds(logits, cfg, bias)
    assert torch.equal(got_ids, want_ids) and torch.equal(got_w.view(torch.int32), want_w.view(torch.int32))
    bias[3:] = float("-inf")  # three finite choices, then -inf ones: the lowest index, not a padding lane
    _, ids = small_m.fused_select_experts(logits, cfg, bias)
    assert sorted(ids[:, :3].flatten().tolist()) == [0, 0, 0, 1, 1, 1, 2, 2, 2] and ids[:, 3].tolist() == [3, 3, 3]


@pytest.mark.filterwarnings("ignore:invalid value encountered")  # the interpreter's numpy on NaN - NaN
@pytest.mark.parametrize("case", ["60-top4-softmax-raw", "64-top6-sigmoid-bias", "33-top1-softmax-bias"])
def test_fused_router_nan_rows_get_distinct_ids_in_range(case):
    """A NaN row (a padding row) still gets top_k distinct ids in [0, E), never a padding lane; a
    sigmoid row with a few NaN logits picks around them (NaN ranks as -inf), as does a row of -inf
    choices (a -inf correction bias), which goes by index."""
    e, cfg, with_bias = TOP_K_CASES[case]
    bias = torch.zeros(e) if with_bias else None
    logits = torch.randn(3, e, generator=torch.Generator().manual_seed(23))
    logits[0] = float("nan")
    logits[1, : cfg.top_k + 1] = float("nan")
    _, ids = small_m.fused_select_experts(logits, cfg, bias)
    for row in ids.tolist():
        assert len(set(row)) == cfg.top_k and all(0 <= i < e for i in row)
    if cfg.scoring == "sigmoid":
        assert min(ids[1].tolist()) > cfg.top_k
        finite = logits[1].sigmoid().nan_to_num(nan=float("-inf"))
        assert torch.equal(ids[1:2], _first_index_top_k(finite[None], cfg.top_k))
    if with_bias:
        blocked = torch.full((e,), float("-inf"))
        blocked[[5, 2]] = 0.0
        _, ids = small_m.fused_select_experts(logits[2:], cfg, blocked)
        scores = logits[2:].softmax(-1) if cfg.scoring == "softmax" else logits[2:].sigmoid()
        assert torch.equal(ids, _first_index_top_k(scores + blocked, cfg.top_k))  # 2 and 5, then 0, 1, 3, ...


@pytest.mark.parametrize("norm", [True, False])
def test_gate_router_preloaded_and_streamed_give_the_same_bits(norm, monkeypatch):
    """`gate_router_kernel`'s PRELOAD path (every load first, held as chunks) and its streaming
    loops: the same logits order, so the same ids and weights, and with the norm the same x and
    h + residual, bit for bit; H = 1040: two 1024-wide K chunks, the second masked. Also the ids
    of the norm, then the linear layer, then `select_experts`."""
    cfg = RoutingConfig(top_k=4, scoring="sigmoid", routed_scaling_factor=2.5)
    e, h = 16, 1040
    gen = torch.Generator().manual_seed(29)
    gate_w = torch.randn(e, h, generator=gen) * 0.05
    hs, residual = torch.randn(2, h, generator=gen), torch.randn(2, h, generator=gen)
    norm_w = 1 + 0.1 * torch.randn(h, generator=gen)
    bias = torch.randn(e, generator=gen) * 0.1
    arrivals = torch.zeros(4, dtype=torch.int32)
    outs = {}
    for budget in (1 << 30, 0):
        monkeypatch.setattr(small_m, "GATE_PRELOAD_BYTES", budget)
        if norm:
            outs[budget] = small_m.fused_norm_gate_select_experts(hs, residual, norm_w, 1e-6, gate_w, cfg, arrivals,
                                                                  bias)
        else:
            outs[budget] = small_m.fused_gate_select_experts(hs, gate_w, cfg, arrivals, bias)
        assert not arrivals.any()
    for got, want in zip(outs[1 << 30], outs[0]):
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    x = outs[0][0] if norm else hs
    assert torch.equal(outs[0][-1], select_experts(x @ gate_w.t(), cfg, bias)[1])


def test_pdl_switches_never_apply_off_cuda(monkeypatch):
    """The router's and the experts kernel's programmatic dependent launch (`RADIXSERVE_MOE_PDL`,
    `RADIXSERVE_MOE_EXPERTS_PDL`) need sm90 and a Triton with PDL: on CPU tensors (the interpreter, which has
    no griddepcontrol) both stay off whatever the switches say, and the launch keywords carry no wait."""
    monkeypatch.setattr(small_m, "MOE_PDL", True)
    monkeypatch.setattr(small_m, "MOE_EXPERTS_PDL", True)
    x = torch.zeros(1, 8)
    assert not small_m.moe_pdl(x) and not small_m.moe_experts_pdl(x)
    assert triton_support.pdl_launch(False) == {"GDC": False}
    assert triton_support.pdl_launch(True) == {"GDC": True, "launch_pdl": True}
