"""Every in-tree component passes the conformance kit of its kind (radixserve.testing), the same
kits third-party plugins run. Component-specific behaviour stays in each component's own tests."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from radixserve.plugins.registry import Registry
from radixserve.testing import (
    check_attention_backend,
    check_drafter,
    check_model_parity,
    check_prefix_cache,
    check_quant_method,
    check_quant_method_moe,
    check_schedule_policy,
    tiny_checkpoint,
)

EXAMPLE_POLICY = Path(__file__).resolve().parents[1] / "docs" / "examples" / "radixserve-example-policy"


@pytest.fixture(scope="module")
def registry() -> Registry:
    return Registry.discover()


# ---- attention (cpu_batched: plugins/attention/cpu_batched/tests; triton: tests/test_attention_triton.py) ----


def test_torch_native_attention(registry):
    cls = registry.load("attention", "torch_native")
    assert registry.get("attention", "torch_native").supports_device("cpu")
    check_attention_backend(cls)
    check_attention_backend(cls, kv_dtype=torch.bfloat16, heads=((4, 2, 64),), seeds=(0,))  # supports_bf16_kv_cache


def test_the_attention_kit_reports_each_scenario_as_it_starts(registry):
    """`check_attention_backend(progress=)`: one line per scenario and per tree pass, in order, with the seconds
    since the kit began, then "done" (where a slow backend spends the kit)."""
    lines = []
    check_attention_backend(registry.load("attention", "torch_native"), heads=((2, 1, 16),), seeds=(0, 1),
                            num_requests=2, decode_steps=1, tree_steps=1, layer_options=((4, 1.5),),
                            progress=lines.append)
    what = [line.rsplit(" (", 1)[0].removeprefix("check_attention_backend float32 ") for line in lines]
    assert what == ["heads (2, 1, 16) seed 0", "heads (2, 1, 16) seed 0: trees",
                    "heads (2, 1, 16) seed 0: decode rows sharing requests", "heads (2, 1, 16) seed 1",
                    "heads (2, 1, 16) seed 1: trees", "heads (2, 1, 16) seed 1: decode rows sharing requests",
                    "heads (2, 1, 16) window 4 cap 1.5",
                    "heads (2, 1, 16) window 4 cap 1.5: trees",
                    "heads (2, 1, 16) seed 0: past key positions [64, 128, 256]", "done"]
    seconds = [float(line.rsplit("(", 1)[1].removesuffix(" s)")) for line in lines]
    assert seconds == sorted(seconds)


# ---- prefix caches ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["radix", "chunk"])
def test_prefix_cache(registry, name):
    check_prefix_cache(registry.load("prefix_cache", name))


# ---- schedule policies --------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["fcfs", "lpm", "dfs-weight", "lof", "priority", "random"])
def test_policy(registry, name):
    check_schedule_policy(registry.load("policy", name))


def test_policy_with_options(registry):
    check_schedule_policy(lambda: registry.load("policy", "random")(seed=7))
    check_schedule_policy(lambda: registry.load("policy", "lpm")(fcfs_threshold=2), end_to_end=False)


def test_the_docs_example_policy(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLE_POLICY))  # importable without installing it
    from radixserve_example_policy.policy import ShortestPromptFirst

    check_schedule_policy(ShortestPromptFirst)


# ---- speculative drafters (the ngram drafter's own behaviour: plugins/speculative/ngram/tests) --------------


def test_ngram_drafter(registry):
    check_drafter(registry.load("drafter", "ngram"), min_acceptance=1.0)


# ---- model family: llama, mistral, qwen2, qwen3 -------------------------------------------------------------

MODEL_CASES = {
    "llama-gqa-untied-llama3rope": (
        "llama",
        dict(
            tie_word_embeddings=False,
            rope_parameters=dict(rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0,
                                 high_freq_factor=4.0, original_max_position_embeddings=64),
        ),
    ),
    "llama-tied-linearrope": (
        "llama",
        dict(tie_word_embeddings=True, rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=2.0)),
    ),
    "mistral-mqa-untied": ("mistral", dict(tie_word_embeddings=False, num_key_value_heads=1)),
    "qwen2-bias-tied-yarn": (
        "qwen2",
        dict(tie_word_embeddings=True, rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                                            original_max_position_embeddings=128)),
    ),
    "qwen3-qknorm-untied": ("qwen3", dict(tie_word_embeddings=False)),
}


@pytest.mark.parametrize("case", sorted(MODEL_CASES))
def test_llama_family_model(registry, case, tmp_path):
    model_type, overrides = MODEL_CASES[case]
    path = tiny_checkpoint(model_type, str(tmp_path), **overrides)
    from transformers import AutoConfig

    arch = AutoConfig.from_pretrained(path).architectures[0]
    check_model_parity(registry.load("model", arch), path, new_tokens=16)


def test_tiny_checkpoint_claims_the_architecture_it_is_given(tmp_path):
    """A plugin author's tiny checkpoint for a family registered under a new name: the name reaches
    config.json (save_pretrained alone writes the class it saved, so the in-tree Llama would run
    in its place without complaint), and the weights are still transformers' Llama."""
    import json

    from safetensors.torch import load_file

    path = tiny_checkpoint("llama", str(tmp_path), architectures=["MyLlamaForCausalLM"])
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["architectures"] == ["MyLlamaForCausalLM"] and saved["model_type"] == "llama"
    assert "model.embed_tokens.weight" in load_file(str(tmp_path / "model.safetensors"))
    assert path == str(tmp_path)


# ---- quantization -------------------------------------------------------------------------------------------


def test_unquantized_method():
    from radixserve.layers.quant_unquantized import UnquantizedMethod

    check_quant_method(UnquantizedMethod, lambda w: ({"weight": w}, w))
    check_quant_method_moe(UnquantizedMethod, lambda w: ({"weight": w}, w))


def test_moe_kit_catches_a_wrong_expert_layout():
    """The MoE step fails, naming apply_moe, for a method whose experts compute the wrong thing
    (here: gate and up swapped)."""
    from radixserve.layers.moe.reference import fused_experts_reference
    from radixserve.layers.quant_unquantized import UnquantizedMethod

    class SwappedHalves(UnquantizedMethod):
        def apply_moe(self, layer, x, topk_weights, topk_ids):
            inter = layer.intermediate_size
            w13 = torch.cat([layer.w13_weight[:, inter:], layer.w13_weight[:, :inter]], dim=1)
            return fused_experts_reference(x, w13, layer.w2_weight, topk_weights, topk_ids)

    with pytest.raises(AssertionError, match="apply_moe"):
        check_quant_method_moe(SwappedHalves, lambda w: ({"weight": w}, w))


def _per_row_int8(w: torch.Tensor) -> torch.Tensor:
    scale = w.abs().amax(dim=1, keepdim=True).clamp_min(1e-8) / 127
    return (w / scale).round().clamp(-127, 127) * scale


def test_quant_kit_tp_sizes_for_a_mode_right_only_unsplit():
    """An online mode that scales each row by what its rank holds is right unsplit and wrong split
    over ranks (the row-parallel shard's scale is not the whole row's): `tp_sizes=(1,)` checks it
    where it is meant to run, and is refused for a method that declares tensor parallelism."""
    from radixserve.layers.quant_unquantized import UnquantizedMethod

    class OnlinePerRowInt8(UnquantizedMethod):
        supports_tensor_parallel = False  # the base class's True: its shards are exact

        def process_weights_after_loading(self, layer):
            layer.weight.data = _per_row_int8(layer.weight.data)  # before the CPU packing sees it
            super().process_weights_after_loading(layer)

    def quantize(w):
        return {"weight": w}, _per_row_int8(w)

    with pytest.raises(AssertionError, match="RowParallelLinear tp 2"):
        check_quant_method(OnlinePerRowInt8, quantize)
    check_quant_method(OnlinePerRowInt8, quantize, tp_sizes=(1,))

    class ClaimsTensorParallel(OnlinePerRowInt8):
        supports_tensor_parallel = True

    with pytest.raises(AssertionError, match="supports_tensor_parallel"):
        check_quant_method(ClaimsTensorParallel, quantize, tp_sizes=(1,))
    with pytest.raises(ValueError, match="tp_sizes"):
        check_quant_method(OnlinePerRowInt8, quantize, tp_sizes=(3,))


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1"])
def test_gguf_method(registry, qtype):
    """GGUF blocks read by the plugin load into layers that compute with gguf's own dequantization."""
    import gguf
    from radixserve_quant_gguf.reader import GGUFTensor
    from radixserve_quant_gguf.tensors import dequantize

    kind = gguf.GGMLQuantizationType[qtype]

    def quantize(w: torch.Tensor):
        raw = gguf.quants.quantize(w.numpy(), kind)
        read = dequantize(GGUFTensor("blk.0.ffn_up.weight", kind, list(reversed(w.shape)), raw))
        reference = torch.from_numpy(gguf.quants.dequantize(raw, kind)).reshape(w.shape)
        return {"weight": read}, reference

    # the dequantized path (the layers hold floats; kept blocks: tests/test_gguf_kept_quantized.py)
    check_quant_method(functools.partial(registry.load("quantization", "gguf"), dequantize=True), quantize, unit=16)
