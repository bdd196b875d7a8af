"""The MoE model plugins (radixserve-models-mixtral, radixserve-models-qwen_moe): the model
conformance kit (greedy parity with transformers, top-5 rule) on tiny random checkpoints, both
checkpoint layouts, a missing expert, discovery, and batch invariance through the runner."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from family_cases import MOE_CASES as CASES
from radixserve.plugins.registry import Registry
from radixserve.testing import check_model_parity, tiny_checkpoint


@pytest.fixture(scope="module")
def registry() -> Registry:
    return Registry.discover()


@pytest.mark.parametrize("arch", sorted(CASES))
def test_moe_model_conformance(registry, arch, tmp_path):
    model_type, overrides = CASES[arch]
    path = tiny_checkpoint(model_type, str(tmp_path), **overrides)
    assert json.load(open(f"{path}/config.json"))["architectures"] == [arch]
    check_model_parity(registry.load("model", arch), path, new_tokens=12)


@pytest.mark.parametrize("arch", ["MixtralForCausalLM", "Qwen3MoeForCausalLM"])
def test_transformers5_stacked_expert_layout_loads(registry, arch, tmp_path):
    """transformers 5 modules hold experts stacked (`experts.gate_up_proj` [E, 2I, H]); a checkpoint
    written from that state dict (Mixtral's block named `mlp`) gives the same model."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    model_type, overrides = CASES[arch]
    ref = tiny_checkpoint(model_type, str(tmp_path / "ref"), **overrides)
    hf = AutoModelForCausalLM.from_pretrained(ref, dtype=torch.float32)
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    if overrides.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    assert any(k.endswith("experts.gate_up_proj") for k in state), sorted(state)[:8]
    stacked = tmp_path / "stacked"
    stacked.mkdir()
    shutil.copy(f"{ref}/config.json", stacked / "config.json")
    save_file(state, str(stacked / "model.safetensors"))
    check_model_parity(registry.load("model", arch), str(stacked), reference=ref, new_tokens=6,
                       prompt_lens=(5, 3))


def test_missing_expert_is_named(registry, tmp_path):
    from radixserve.model_loader.loader import load_model
    from radixserve.model_loader.sources import ModelSource
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig

    model_type, overrides = CASES["Qwen3MoeForCausalLM"]
    path = tiny_checkpoint(model_type, str(tmp_path), **overrides)
    weights = load_file(f"{path}/model.safetensors")
    del weights["model.layers.1.mlp.experts.5.up_proj.weight"]
    save_file(weights, f"{path}/model.safetensors")
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.experts\.w13_weight"):
        load_model(ModelSource(path=path, format="safetensors"), AutoConfig.from_pretrained(path),
                   registry.load("model", "Qwen3MoeForCausalLM"), torch.device("cpu"), torch.float32,
                   show_progress=False)


def test_plugins_are_discovered_with_their_distributions(registry):
    table = {(c.kind, c.name): c.distribution for c in registry.components()}
    assert table[("model", "MixtralForCausalLM")] == "radixserve-models-mixtral"
    assert table[("model", "Qwen2MoeForCausalLM")] == "radixserve-models-qwen_moe"
    assert table[("model", "Qwen3MoeForCausalLM")] == "radixserve-models-qwen_moe"


@pytest.mark.parametrize("precision", ["highest", "medium"])
def test_moe_batch_and_chunking_invariance(tmp_path, precision):
    """A request's greedy output is the same alone, in a mixed batch, and with chunked prefill
    (the CPU expert path groups different tokens per expert in each case); under `medium` too, the
    experts on bf16 panels or, on an AMX CPU, tiles."""
    from radixserve.config import Config
    from radixserve.model_runner import ModelRunner
    from runner_driver import greedy_generate

    model_type, overrides = CASES["Qwen2MoeForCausalLM"]
    path = tiny_checkpoint(model_type, str(tmp_path), **overrides)
    runner = ModelRunner(Config.build({
        "model": {"path": path},
        "runtime": {"device": "cpu", "dtype": "float32", "num_threads": 1, "cpu_matmul_precision": precision},
        "scheduler": {"max_total_tokens": 1024, "max_running_requests": 4},
    }), show_progress=False)
    from radixserve.layers import cpu_gemm

    experts = next(m.packed_experts for m in runner.model.modules() if getattr(m, "packed_experts", None))
    on_tiles = precision == "medium" and cpu_gemm.amx_available()
    assert all((p.amx is not None) == on_tiles for group in experts for p in group)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (5, 13, 2)]
    batched = [g.tokens for g in greedy_generate(runner, prompts, 10)]
    for prompt, want in zip(prompts, batched, strict=True):
        assert greedy_generate(runner, [prompt], 10)[0].tokens == want
        assert greedy_generate(runner, [prompt], 10, prefill_chunk=3)[0].tokens == want
