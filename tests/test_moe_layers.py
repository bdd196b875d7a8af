"""The MoE layers (radixserve.layers.moe): the router against a per-token torch reference, the CPU
expert path and the Triton fused-MoE kernel (TRITON_INTERPRET=1) against the plain computation,
the stacked-expert weight loader, and the QuantMethod MoE contract."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from radixserve.interfaces.quantization import QuantMethod
from radixserve.layers.moe import FusedMoE, RoutingConfig, select_experts
from radixserve.layers.moe.cpu import cpu_fused_experts, pack_experts
from radixserve.layers.moe.reference import fused_experts_reference
from radixserve.layers.moe.triton_kernel import align_pairs_by_expert, triton_fused_experts


def _route_one(logits: torch.Tensor, cfg: RoutingConfig, bias: torch.Tensor | None) -> dict[int, float]:
    """One token's routing, written plainly: expert id -> weight."""
    scores = logits.double().softmax(-1) if cfg.scoring == "softmax" else logits.double().sigmoid()
    choice = scores + (bias.double() if bias is not None else 0.0)
    eligible = list(range(len(scores)))
    if cfg.num_expert_group:
        size = len(scores) // cfg.num_expert_group
        groups = [list(range(g * size, (g + 1) * size)) for g in range(cfg.num_expert_group)]
        def group_score(members):
            vals = sorted((float(choice[e]) for e in members), reverse=True)
            return sum(vals[:2]) if bias is not None else vals[0]
        best = sorted(groups, key=group_score, reverse=True)[: cfg.topk_group]
        eligible = [e for g in best for e in g]
    chosen = sorted(eligible, key=lambda e: float(choice[e]), reverse=True)[: cfg.top_k]
    weights = {e: float(scores[e]) for e in chosen}
    if cfg.renormalize:
        total = sum(weights.values())
        weights = {e: w / total for e, w in weights.items()}
    return {e: w * cfg.routed_scaling_factor for e, w in weights.items()}


ROUTINGS = {
    "softmax-renorm": (RoutingConfig(top_k=2, scoring="softmax", renormalize=True), False),
    "softmax-raw": (RoutingConfig(top_k=3, scoring="softmax", renormalize=False), False),
    "sigmoid-renorm": (RoutingConfig(top_k=2, scoring="sigmoid", renormalize=True), False),
    "sigmoid-raw-scaled": (RoutingConfig(top_k=2, scoring="sigmoid", renormalize=False, routed_scaling_factor=2.5),
                           False),
    "grouped-softmax": (RoutingConfig(top_k=3, scoring="softmax", renormalize=False, num_expert_group=4,
                                      topk_group=2), False),
    "grouped-sigmoid-bias": (RoutingConfig(top_k=4, scoring="sigmoid", renormalize=True, num_expert_group=4,
                                           topk_group=2, routed_scaling_factor=2.5), True),
}


@pytest.mark.parametrize("case", sorted(ROUTINGS))
def test_routing_matches_plain_reference(case):
    cfg, with_bias = ROUTINGS[case]
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(9, 16, generator=gen) * 2
    bias = torch.randn(16, generator=gen) * 0.3 if with_bias else None
    weights, ids = select_experts(logits, cfg, bias)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32 and ids.shape == (9, cfg.top_k)
    for t in range(9):
        want = _route_one(logits[t], cfg, bias)
        got = {int(e): float(w) for e, w in zip(ids[t], weights[t], strict=True)}
        assert set(got) == set(want), f"token {t}: experts {sorted(got)}, reference {sorted(want)}"
        for e, w in want.items():
            assert got[e] == pytest.approx(w, rel=1e-5), f"token {t}, expert {e}"


def test_grouped_routing_only_picks_from_the_best_groups():
    """With a bias that favours group 3's experts, no token may pick outside the chosen groups."""
    cfg = RoutingConfig(top_k=2, scoring="sigmoid", num_expert_group=4, topk_group=1)
    bias = torch.zeros(16)
    bias[12:] = 10.0
    _, ids = select_experts(torch.randn(6, 16), cfg, bias)
    assert bool((ids >= 12).all()), ids


@pytest.mark.parametrize("bad, match", [
    (dict(scoring="relu"), "relu"),
    (dict(top_k=17), "top_k=17"),
    (dict(num_expert_group=5, topk_group=1), "num_expert_group=5"),
    (dict(num_expert_group=4, topk_group=9), "topk_group=9"),
])
def test_bad_routing_configuration_is_a_clear_error(bad, match):
    with pytest.raises(ValueError, match=match):
        FusedMoE(16, 8, 8, RoutingConfig(**{"top_k": 2, **bad}))


def _experts(e=4, h=32, i=48, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(e, 2 * i, h, generator=gen) * 0.2).to(dtype)
    w2 = (torch.randn(e, h, i, generator=gen) * 0.2).to(dtype)
    return w13, w2


def _routing(t, e, k, seed=1):
    gen = torch.Generator().manual_seed(seed)
    weights, ids = select_experts(torch.randn(t, e, generator=gen), RoutingConfig(top_k=k))
    return weights, ids


def test_reference_is_the_per_expert_mlp():
    """The reference the fused paths are held to, checked once by hand for one token."""
    w13, w2 = _experts(e=3, h=8, i=4)
    x = torch.randn(1, 8)
    ids = torch.tensor([[2, 0]], dtype=torch.int32)
    weights = torch.tensor([[0.7, 0.3]])
    def mlp(e):
        g, u = (x @ w13[e].T).chunk(2, -1)
        return (F.silu(g) * u) @ w2[e].T
    torch.testing.assert_close(fused_experts_reference(x, w13, w2, weights, ids), 0.7 * mlp(2) + 0.3 * mlp(0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_experts_match_reference(dtype):
    w13, w2 = _experts(dtype=dtype)
    x = torch.randn(11, 32).to(dtype)
    weights, ids = _routing(11, 4, 2)
    packed = pack_experts(w13, w2)
    if dtype == torch.float32:
        assert packed is not None, "fp32 CPU experts should pack for the native GEMM"
    got = cpu_fused_experts(x, w13, w2, weights, ids, packed)
    want = fused_experts_reference(x, w13, w2, weights, ids)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(got, want, **tol)


def test_align_pairs_by_expert_covers_every_pair_once_in_single_expert_tiles():
    ids = torch.tensor([[3, 0], [0, 1], [3, 0], [2, 3], [0, 2]], dtype=torch.int32)
    sorted_ids, tile_expert = align_pairs_by_expert(ids, 5, 4)
    pairs = ids.numel()
    real = sorted_ids[sorted_ids < pairs].tolist()
    assert sorted(real) == list(range(pairs))
    flat = ids.reshape(-1)
    for tile, expert in enumerate(tile_expert.tolist()):
        members = [p for p in sorted_ids[tile * 4 : (tile + 1) * 4].tolist() if p < pairs]
        if expert < 0:
            assert not members
        else:
            assert members and all(int(flat[p]) == expert for p in members)
    assert (tile_expert >= 0).sum() == 4  # experts 0 (4 pairs), 1, 2, 3: one tile each


@pytest.mark.parametrize("dtype, t, k, e, block_m", [
    (torch.float32, 5, 2, 4, 16),
    (torch.float32, 21, 3, 5, 16),   # several tiles for one expert, an expert nobody picks
    (torch.bfloat16, 7, 2, 4, 16),
    (torch.bfloat16, 9, 2, 3, 32),
])
def test_triton_fused_moe_matches_reference_under_interpret(dtype, t, k, e, block_m):
    w13, w2 = _experts(e=e, h=32, i=48, dtype=dtype, seed=t)
    x = torch.randn(t, 32).to(dtype)
    weights, ids = _routing(t, e, k, seed=t)
    if e == 5:  # nobody routes to expert 4
        ids = torch.where(ids == 4, torch.zeros_like(ids), ids)
        ids[:, 1] = torch.where(ids[:, 0] == ids[:, 1], (ids[:, 0] + 1) % 4, ids[:, 1])
    got = triton_fused_experts(x, w13, w2, weights, ids, block_m=block_m)
    want = fused_experts_reference(x, w13, w2, weights, ids)
    assert got.dtype == dtype and got.shape == (t, 32)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=4e-2, rtol=4e-2)
    torch.testing.assert_close(got, want, **tol)


def _layer(e=4, h=32, i=48, **kw) -> FusedMoE:
    return FusedMoE(e, h, i, RoutingConfig(top_k=2), prefix="model.layers.0.mlp.experts", **kw)


def test_weight_loader_per_expert_and_stacked_layouts_agree():
    w13, w2 = _experts()
    per_expert, stacked, halves = _layer(), _layer(), _layer()
    for e in range(4):
        gate, up = w13[e].chunk(2, 0)
        for shard, tensor in (("w1", gate), ("up", up)):
            per_expert.w13_weight.weight_loader(per_expert.w13_weight, tensor, shard, expert_id=e)
        per_expert.w2_weight.weight_loader(per_expert.w2_weight, w2[e], "down", expert_id=e)
    stacked.w13_weight.weight_loader(stacked.w13_weight, w13)
    stacked.w2_weight.weight_loader(stacked.w2_weight, w2)
    gate_all, up_all = w13.chunk(2, 1)
    halves.w13_weight.weight_loader(halves.w13_weight, gate_all, "gate")
    halves.w13_weight.weight_loader(halves.w13_weight, up_all, "up")
    halves.w2_weight.weight_loader(halves.w2_weight, w2)
    for layer in (per_expert, stacked, halves):
        assert layer.incomplete_params() == []
        assert torch.equal(layer.w13_weight, w13) and torch.equal(layer.w2_weight, w2)


def test_weight_loader_errors_and_missing_experts():
    layer = _layer()
    with pytest.raises(ValueError, match="'gate_proj'"):
        layer.weight_loader(layer.w13_weight, torch.zeros(48, 32), "gate_proj", expert_id=0)
    with pytest.raises(ValueError, match="expert id 4 out of range"):
        layer.weight_loader(layer.w13_weight, torch.zeros(48, 32), "gate", expert_id=4)
    with pytest.raises(ValueError, match=r"\(48, 31\).*\(48, 32\)"):
        layer.weight_loader(layer.w13_weight, torch.zeros(48, 31), "gate", expert_id=0)
    for e in range(4):
        layer.weight_loader(layer.w13_weight, torch.zeros(48, 32), "gate", expert_id=e)
        if e != 2:
            layer.weight_loader(layer.w13_weight, torch.zeros(48, 32), "up", expert_id=e)
    assert layer.incomplete_params() == ["w13_weight", "w2_weight"]


def test_checkpoint_name_mapping():
    m = FusedMoE.map_checkpoint_name
    assert m("model.layers.3.mlp.experts.11.up_proj.weight") == ("model.layers.3.mlp.experts.w13_weight", 11, "up")
    assert m("model.layers.0.block_sparse_moe.experts.2.w2.weight", gate="w1", up="w3", down="w2") == (
        "model.layers.0.block_sparse_moe.experts.w2_weight", 2, "down")
    assert m("model.layers.0.mlp.experts.gate_up_proj") == ("model.layers.0.mlp.experts.w13_weight", None, None)
    assert m("model.layers.0.mlp.shared_expert.gate_proj.weight") is None
    assert m("model.layers.0.mlp.gate.weight") is None


def test_layer_forward_routes_then_runs_experts():
    layer = _layer()
    w13, w2 = _experts()
    layer.w13_weight.data.copy_(w13)
    layer.w2_weight.data.copy_(w2)
    layer.quant_method.process_moe_weights_after_loading(layer)
    x, logits = torch.randn(6, 32), torch.randn(6, 4)
    weights, ids = select_experts(logits, layer.routing)
    torch.testing.assert_close(layer(x, logits), fused_experts_reference(x, w13, w2, weights, ids),
                               atol=1e-4, rtol=1e-4)


class _LinearOnlyMethod(QuantMethod):
    def create_weights(self, layer, input_size, output_sizes, dtype):
        raise AssertionError("not used")

    def apply(self, layer, x, bias):
        raise AssertionError("not used")


def test_quant_method_without_moe_support_refuses_naming_method_and_layer():
    with pytest.raises(ValueError, match=r"_LinearOnlyMethod does not support MoE.*model\.layers\.0\.mlp\.experts"):
        _layer(quant_method=_LinearOnlyMethod())


def test_installed_quantized_methods_refuse_moe():
    from radixserve_quant_fp8.method import FP8Method

    with pytest.raises(ValueError, match="FP8Method does not support MoE"):
        _layer(quant_method=FP8Method())


def test_tensor_parallel_experts_are_not_implemented():
    with pytest.raises(NotImplementedError, match="tp_size=2"):
        _layer(tp_size=2, tp_rank=0)
