"""The DeepSeek model plugin (radixserve-models-deepseek) on tiny random checkpoints, CPU:
greedy parity with transformers through the model kit (top-5 rule) for V2-Lite / V2 / V3 shapes;
the router and the softmax scale against transformers' own modules; an FP8 block-quantized
kv_b_proj dequantized at load; MTP layers skipped; alone vs batched and radix cache on/off through
the scheduler; discovery under its distribution."""

from __future__ import annotations

import random

import pytest
import torch
from deepseek_cases import ARCHS, CASES, write_checkpoint
from radixserve.plugins.registry import Registry
from radixserve.testing import check_model_parity
from radixserve_models_deepseek.model import DeepseekDecoderLayer, DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
from radixserve_models_deepseek.moe import DeepseekMoE, routing_from_config
from radixserve_models_deepseek.weights import dequantize_fp8

VOCAB = 512


@pytest.fixture(scope="module")
def registry() -> Registry:
    return Registry.discover()


def _hf(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


@pytest.mark.parametrize("case", sorted(CASES))
def test_parity_with_transformers(registry, case, tmp_path):
    """The kit on torch_native's latent attention (the CPU default for latent models): chunked
    prefill in mixed batches, a prefix-cache hit, decode; top-5 rule."""
    model_type, _ = CASES[case]
    path = write_checkpoint(case, str(tmp_path))
    check_model_parity(registry.load("model", ARCHS[model_type]), path, new_tokens=10,
                       attention=registry.load("attention", "torch_native"))


@pytest.mark.parametrize("model_type", sorted(ARCHS))
def test_tiny_checkpoint_defaults_make_working_models(registry, model_type, tmp_path):
    """`tiny_checkpoint("deepseek_v2", dir)` with no overrides: transformers' defaults alone gave a
    null experts-per-token (V2), fewer KV heads than heads and full-size latent widths, and the kit
    then failed inside transformers; an outside author had to find working settings by trial."""
    from radixserve.testing import tiny_checkpoint

    path = tiny_checkpoint(model_type, str(tmp_path))
    check_model_parity(registry.load("model", ARCHS[model_type]), path, new_tokens=6)


def test_a_null_experts_per_token_is_a_value_error_naming_it():
    from transformers import AutoConfig

    cfg = AutoConfig.for_model("deepseek_v2", **{**CASES["v2-lite-yarn"][1], "num_experts_per_tok": None})
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        routing_from_config(cfg, sigmoid_noaux=False).validate(8)


def test_v3_correction_bias_and_yarn_matter(tmp_path):
    """The V3 case would catch a loader that drops e_score_correction_bias or a model that ignores
    YaRN's softmax mscale: each changes transformers' own logits on that checkpoint."""
    path = write_checkpoint("v3-noaux-yarn", str(tmp_path))
    hf = _hf(path)
    ids = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        base = hf(input_ids=ids).logits
        for layer in hf.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.zero_()
        no_bias = hf(input_ids=ids).logits
        for layer in hf.model.layers:
            layer.self_attn.scaling = (16 + 8) ** -0.5
        no_mscale = hf(input_ids=ids).logits
    assert (base - no_bias).abs().max() > 1e-3
    assert (no_bias - no_mscale).abs().max() > 1e-3


@pytest.mark.parametrize("case", ["v2-qlora-grouped", "v3-noaux-yarn"])
def test_router_matches_transformers(case, tmp_path):
    """Expert choice and weights of the MoE block equal transformers' router (grouped top-k; V3's
    biased choice with unbiased, renormalised, scaled weights)."""
    path = write_checkpoint(case, str(tmp_path))
    hf = _hf(path)
    hf_moe = hf.model.layers[1].mlp
    ours = DeepseekMoE(hf.config, None, sigmoid_noaux=CASES[case][0] == "deepseek_v3")
    ours.gate.weight.data.copy_(hf_moe.gate.weight.data)
    if ours.experts.e_score_correction_bias is not None:
        ours.experts.e_score_correction_bias.data.copy_(hf_moe.gate.e_score_correction_bias)
    x = torch.randn(64, hf.config.hidden_size, generator=torch.Generator().manual_seed(1))
    from radixserve.layers.moe import select_experts

    weights, ids = select_experts(ours.gate(x), ours.experts.routing, ours.experts.e_score_correction_bias)
    _, ref_w, ref_ids = hf_moe.gate(x)
    order, ref_order = ids.sort(-1), ref_ids.sort(-1)
    assert torch.equal(order.values.long(), ref_order.values)
    torch.testing.assert_close(weights.gather(1, order.indices), ref_w.gather(1, ref_order.indices))


def test_unsupported_routing_and_activation_are_named():
    from transformers import AutoConfig

    cfg = AutoConfig.for_model("deepseek_v2", topk_method="noaux_tc", num_experts_per_tok=2)
    with pytest.raises(ValueError, match="topk_method='noaux_tc'"):
        routing_from_config(cfg, sigmoid_noaux=False)
    cfg = AutoConfig.for_model("deepseek_v3", scoring_func="softmax")
    with pytest.raises(ValueError, match="scoring_func='softmax'"):
        routing_from_config(cfg, sigmoid_noaux=True)
    cfg = AutoConfig.for_model("deepseek_v2", hidden_act="gelu", **CASES["v2-lite-yarn"][1])
    with torch.device("meta"), pytest.raises(ValueError, match="hidden_act 'gelu'"):
        DeepseekDecoderLayer(cfg, 0)  # a dense layer


def test_dequantize_fp8_blocks_with_partial_edges():
    w = torch.randn(10, 7)
    scale = torch.tensor([[2.0, 0.5], [4.0, 1.0], [0.25, 8.0]])  # blocks of 4x4: 3 x 2 tiles, the last partial
    q = (w / scale.repeat_interleave(4, 0).repeat_interleave(4, 1)[:10, :7]).to(torch.float8_e4m3fn)
    want = q.float() * scale.repeat_interleave(4, 0).repeat_interleave(4, 1)[:10, :7]
    torch.testing.assert_close(dequantize_fp8(q, scale, (4, 4)), want)
    with pytest.raises(ValueError, match=r"expected \(3, 2\)"):
        dequantize_fp8(q, scale[:2], (4, 4))


def _block_fp8(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(fp8 weight, fp32 scale per block x block tile [ceil(out/b), ceil(in/b)], the dequantized
    fp32 weight): DeepSeek-V3's `weight` / `weight_scale_inv` layout, partial edge tiles included."""
    tiles = (-(-w.shape[0] // block), -(-w.shape[1] // block))
    padded = torch.zeros(tiles[0] * block, tiles[1] * block)
    padded[: w.shape[0], : w.shape[1]] = w
    scale = (padded.view(tiles[0], block, tiles[1], block).abs().amax(dim=(1, 3)) / 448.0).clamp(min=1e-12)
    full = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)[: w.shape[0], : w.shape[1]]
    q = (w / full).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q, scale, q.float() * full


def _write_fp8(src: str, dst: str, ref: str, which, quant_config: dict | None = None) -> None:
    """`dst`: `src` with the weights `which(name)` selects in block FP8 (+ `quantization_config`);
    `ref`: the same model with those weights dequantized to float, for transformers."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    weights = load_file(f"{src}/model.safetensors")
    quantized, dequantized = dict(weights), dict(weights)
    for name in [n for n in weights if which(n)]:
        q, scale, deq = _block_fp8(weights[name])
        quantized[name], quantized[name + "_scale_inv"], dequantized[name] = q, scale, deq
    for d, tensors in ((dst, quantized), (ref, dequantized)):
        shutil.copytree(src, d)
        save_file(tensors, f"{d}/model.safetensors", metadata={"format": "pt"})
    if quant_config is not None:
        cfg = json.load(open(f"{dst}/config.json"))
        json.dump({**cfg, "quantization_config": quant_config}, open(f"{dst}/config.json", "w"))


def test_fp8_block_kv_b_proj_is_dequantized_at_load(registry, tmp_path):
    """A checkpoint whose kv_b_proj is block FP8 (as DeepSeek-V3's) loads into the float kv_b_proj
    the latent backend reads, and matches transformers on the dequantized weights."""
    from radixserve.testing import tiny_checkpoint

    # kv_b_proj [8 heads * 32, 160]: 2 x 2 tiles of 128, the column edge partial
    _, overrides = CASES["v3-noaux-yarn"]
    src = tiny_checkpoint("deepseek_v3", str(tmp_path / "src"),
                          **{**overrides, "kv_lora_rank": 160, "num_attention_heads": 8, "num_key_value_heads": 8})
    _write_fp8(src, str(tmp_path / "fp8"), str(tmp_path / "ref"), lambda n: n.endswith("kv_b_proj.weight"))
    check_model_parity(registry.load("model", "DeepseekV3ForCausalLM"), str(tmp_path / "fp8"),
                       reference=str(tmp_path / "ref"), new_tokens=6, prompt_lens=(5, 3))


FP8_BLOCK = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [128, 128]}
# every dimension a linear quantizes is a multiple of 128; kv_a_proj_with_mqa's 512 + 64 rows are not
FP8_SHAPES = dict(hidden_size=256, intermediate_size=256, num_attention_heads=2, num_key_value_heads=2, head_dim=64,
                  q_lora_rank=128, kv_lora_rank=512, qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=64,
                  num_hidden_layers=2, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=128,
                  n_group=1, topk_group=1)


def _fp8_v3_parity(registry, tmp_path, first_k_dense_replace: int):
    """A tiny DeepSeek-V3 with every decoder `*proj.weight` (experts included) in block FP8, checked
    through the fp8 method against transformers on the dequantized weights; returns (its config,
    the fp8 method)."""
    from radixserve.testing import tiny_checkpoint
    from transformers import AutoConfig

    src = tiny_checkpoint("deepseek_v3", str(tmp_path / "src"), **FP8_SHAPES,
                          first_k_dense_replace=first_k_dense_replace)
    _write_fp8(src, str(tmp_path / "fp8"), str(tmp_path / "ref"),
               lambda n: n.startswith("model.layers.") and n.endswith("proj.weight"), FP8_BLOCK)
    fp8 = registry.load("quantization", "fp8").from_config(FP8_BLOCK)
    check_model_parity(registry.load("model", "DeepseekV3ForCausalLM"), str(tmp_path / "fp8"), quant_method=fp8,
                       reference=str(tmp_path / "ref"), new_tokens=6, prompt_lens=(5, 3))
    return AutoConfig.from_pretrained(src), fp8


def test_fp8_block_checkpoint_through_the_fp8_method(registry, tmp_path):
    """A DeepSeek-V3 block-FP8 checkpoint with dense layers only runs
    through the fp8 quant method: q/o/MLP projections stay FP8, kv_b_proj and the 576-row
    kv_a_proj_with_mqa are dequantized into float; greedy parity with transformers on the
    dequantized weights."""
    config, fp8 = _fp8_v3_parity(registry, tmp_path, first_k_dense_replace=2)
    with torch.device("meta"):
        attn = DeepseekDecoderLayer(config, 0, fp8).self_attn
    assert attn.q_b_proj.weight.dtype == torch.float8_e4m3fn and attn.o_proj.weight.dtype == torch.float8_e4m3fn
    assert attn.kv_a_proj_with_mqa.weight.dtype == torch.float32 and attn.kv_b_proj.weight.dtype == torch.float32


def test_fp8_block_experts_match_transformers(registry, tmp_path):
    """DeepSeek-V3's layout: every expert's gate/up/down in block FP8 with its `weight_scale_inv`
    (layer 1 is MoE). The experts stay FP8 in memory and match transformers on the dequantized
    weights: prompts of 5 and 3 tokens take the all-experts path, decode steps (2 pairs < 4 experts)
    the per-pair path."""
    config, fp8 = _fp8_v3_parity(registry, tmp_path, first_k_dense_replace=1)
    with torch.device("meta"):
        experts = DeepseekV3ForCausalLM(config, fp8).model.layers[1].mlp.experts
    assert experts.w13_weight.dtype == torch.float8_e4m3fn and experts.w2_weight.dtype == torch.float8_e4m3fn
    assert tuple(experts.w13_weight_scale_inv.shape) == (4, 2, 2)  # 2 x 128 rows, 256 columns


def test_online_fp8_moe_layers_are_refused_naming_the_method(registry):
    """Online FP8 (a float checkpoint quantized at load) has no expert path: refused by name."""
    from transformers import AutoConfig

    cfg = AutoConfig.for_model("deepseek_v3", **FP8_SHAPES, first_k_dense_replace=1)
    fp8 = registry.load("quantization", "fp8")()
    with torch.device("meta"), pytest.raises(ValueError, match=r"FP8Method does not support MoE.*model\.layers\.1\.mlp"):
        DeepseekV3ForCausalLM(cfg, fp8)


def test_fp8_weight_without_its_scale_is_named(tmp_path):
    from radixserve.model_loader.loader import load_model
    from radixserve.model_loader.sources import ModelSource
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig

    path = write_checkpoint("v2-lite-yarn", str(tmp_path))
    weights = load_file(f"{path}/model.safetensors")
    name = "model.layers.1.self_attn.kv_b_proj.weight"
    weights[name] = weights[name].to(torch.float8_e4m3fn)
    save_file(weights, f"{path}/model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"kv_b_proj\.weight.*float8.*weight_scale_inv"):
        load_model(ModelSource(path=path, format="safetensors"), AutoConfig.from_pretrained(path),
                   DeepseekV2ForCausalLM, torch.device("cpu"), torch.float32, show_progress=False)


def test_mtp_layers_are_skipped_and_the_decoder_layer_builds_alone(tmp_path):
    """DeepSeek-V3 checkpoints carry the MTP layer as `model.layers.{num_hidden_layers}.*`: the
    target model skips it (the MTP drafter loads it), and the drafter can build that layer alone."""
    from radixserve.model_loader.loader import load_model
    from radixserve.model_loader.sources import ModelSource
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig

    path = write_checkpoint("v3-noaux-yarn", str(tmp_path))
    cfg = AutoConfig.from_pretrained(path)
    weights = load_file(f"{path}/model.safetensors")
    n = cfg.num_hidden_layers
    extra = {k.replace(f"model.layers.{n - 1}.", f"model.layers.{n}."): v.clone()
             for k, v in weights.items() if k.startswith(f"model.layers.{n - 1}.")}
    extra[f"model.layers.{n}.eh_proj.weight"] = torch.zeros(cfg.hidden_size, 2 * cfg.hidden_size)
    save_file({**weights, **extra}, f"{path}/model.safetensors", metadata={"format": "pt"})
    load_model(ModelSource(path=path, format="safetensors"), cfg, DeepseekV3ForCausalLM, torch.device("cpu"),
               torch.float32, show_progress=False)
    layer = DeepseekDecoderLayer(cfg, n, None, f"model.layers.{n}", attn_layer_id=0)
    assert type(layer.mlp).__name__ == "DeepseekMoE" and layer.self_attn.attn.layer_id == 0


# ---- through the runner and the scheduler ----------------------------------------------------
def _scheduler(path: str, cache: str):
    from radixserve.config import Config
    from radixserve.model_runner import ModelRunner
    from radixserve.scheduler import Scheduler

    reg = Registry.discover()
    cfg = Config.build({
        "model": {"path": path}, "stack": {"prefix_cache": cache},
        "runtime": {"device": "cpu", "dtype": "float32", "num_threads": 1},
        "scheduler": {"max_total_tokens": 2048, "max_running_requests": 8, "chunked_prefill_size": 16},
    })
    runner = ModelRunner(cfg, show_progress=False)
    prefix_cache = reg.load("prefix_cache", cache)(runner.req_to_token_pool, runner.token_allocator)
    return Scheduler(cfg, runner, prefix_cache, reg.load("policy", "fcfs")())


def test_alone_batched_and_radix_cache_invariance(tmp_path):
    """Greedy outputs are the same alone and in a batch, with the radix cache serving shared
    prefixes and without a prefix cache (chunk), through the runner's latent pool."""
    from radixserve.runtime.messages import GenerateRequest
    from radixserve.state import SamplingParams
    from radixserve.testing import run_to_completion

    path = write_checkpoint("v3-noaux-yarn", str(tmp_path))
    rng = random.Random(0)
    base = [rng.randrange(VOCAB) for _ in range(20)]
    prompts = [(base if i % 2 else []) + [rng.randrange(VOCAB) for _ in range(rng.randint(3, 9))] for i in range(5)]

    def reqs(ps):
        return [GenerateRequest(rid=f"r{i}", input_ids=p, sampling_params=SamplingParams(
            max_new_tokens=8, temperature=0, ignore_eos=True)) for i, p in enumerate(ps)]

    plain = run_to_completion(_scheduler(path, "chunk"), reqs(prompts))
    radix = _scheduler(path, "radix")
    assert run_to_completion(radix, reqs(prompts)) == plain
    assert run_to_completion(radix, reqs(prompts)) == plain  # second pass: every prompt hits the cache
    alone = _scheduler(path, "chunk")
    for i, p in enumerate(prompts[:3]):
        assert run_to_completion(alone, [reqs([p])[0]]) == {"r0": plain[f"r{i}"]}


def test_registered_under_its_distribution(registry, capsys):
    """Discovered under its distribution, listed by `radixserve plugins`; tensor parallelism (not
    implemented yet) refused by name."""
    from radixserve.cli import main
    from radixserve.model_runner import check_model_tensor_parallel
    from radixserve.plugins.registry import PluginError
    from transformers import AutoConfig

    table = {(c.kind, c.name): c.distribution for c in registry.components()}
    for arch in ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"):
        assert table[("model", arch)] == "radixserve-models-deepseek"
        cls = registry.load("model", arch)
        assert cls.attention_type == "latent"
        with pytest.raises(PluginError, match=f"runtime.tp_size=2: model architecture '{arch}'.*set runtime.tp_size=1"):
            check_model_tensor_parallel(arch, cls, None, AutoConfig.for_model("deepseek_v3"), 2)
    main(["plugins"])
    listed = capsys.readouterr().out
    assert "DeepseekV2ForCausalLM" in listed and "DeepseekV3ForCausalLM" in listed


def test_config_show_names_the_attention_a_latent_model_runs_with(tmp_path, capsys):
    """`config show --model DIR` resolves the stack as the runner does, with the model's KV kind: a
    latent model's default attention is the latent-capable torch_native (it showed the standard
    default, cpu_batched, which the runtime then did not use)."""
    from radixserve.cli import main
    from radixserve.testing import tiny_checkpoint

    path = tiny_checkpoint("deepseek_v3", str(tmp_path))
    assert main(["config", "show", "--model", path, "runtime.device=cpu"]) == 0
    out = capsys.readouterr().out
    assert "  attention: torch_native  # stack.attention" in out, out
    assert "native plugin" in out.splitlines()[-1] and "DeepseekV3ForCausalLM" in out.splitlines()[-1]

