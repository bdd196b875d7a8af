"""The transformers fallback (radixserve-models-transformers) and `model.impl`: parity with
transformers through the runner, selection and its errors, features it refuses by name, and the
graph-safety of its forward (no host synchronisation: it runs on the meta device)."""

from __future__ import annotations

import logging

import pytest
import torch
from family_cases import DENSE_CASES
from hf_reference import hf_greedy
from meta_decode import meta_decode_logits
from radixserve.config import Config, ConfigError
from radixserve.model_runner import ModelRunner
from radixserve.plugins.model_select import select_model
from radixserve.plugins.registry import PluginError, Registry
from radixserve.testing import check_model_parity, tiny_checkpoint
from radixserve_models_transformers.attention import UnsupportedModelError
from radixserve_models_transformers.model import TransformersForCausalLM
from runner_driver import greedy_generate
from transformers import AutoConfig, AutoModelForCausalLM


def _runner(path: str, impl: str) -> ModelRunner:
    cfg = Config.build({
        "model": {"path": path, "impl": impl},
        "runtime": {"device": "cpu", "dtype": "float32", "num_threads": 1},
        "scheduler": {"max_total_tokens": 1024, "max_running_requests": 8},
    })
    return ModelRunner(cfg, show_progress=False)


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory) -> str:
    """GPT-2: no native plugin, absolute position embeddings, a config without num_key_value_heads
    whose attention is MHA (the KV shape comes from the model, not the config)."""
    return tiny_checkpoint("gpt2", str(tmp_path_factory.mktemp("gpt2")), bos_token_id=1, eos_token_id=2)


def test_auto_falls_back_for_an_unclaimed_architecture_and_matches_transformers(gpt2_dir, caplog):
    with caplog.at_level(logging.INFO, logger="radixserve.model_runner"):
        runner = _runner(gpt2_dir, "auto")
    assert isinstance(runner.model, TransformersForCausalLM)
    assert any("GPT2LMHeadModel: transformers fallback" in r.getMessage() for r in caplog.records)
    assert runner.kv_pool.k_buffers[0].shape[1:] == (4, 16)  # 4 KV heads (MHA), not the config's 2
    hf = AutoModelForCausalLM.from_pretrained(gpt2_dir, dtype=torch.float32).eval()
    prompts = [[5, 9, 33, 2, 7], list(range(40, 47)), [8, 8, 1, 9, 30, 31, 4, 6]]  # 2 chunks each
    ours = greedy_generate(runner, prompts, 12, prefill_chunk=4)  # batched, chunked prefill
    for prompt, gen in zip(prompts, ours, strict=True):
        assert gen.tokens == hf_greedy(hf, prompt, 12)[0]


def test_forced_fallback_equals_the_native_plugin(tiny_llama_dir, caplog):
    """model.impl: transformers on an architecture with a native plugin: same greedy tokens."""
    path = tiny_llama_dir("qwen3")
    with caplog.at_level(logging.INFO, logger="radixserve.model_runner"):
        fallback = _runner(path, "transformers")
    assert type(fallback.model).__name__ == "TransformersForCausalLM"
    assert any("forced by model.impl=transformers" in r.getMessage() for r in caplog.records)
    native = _runner(path, "auto")
    assert type(native.model).__name__ == "Qwen3ForCausalLM"
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [7, 7, 7]]
    assert [g.tokens for g in greedy_generate(fallback, prompts, 10)] == \
        [g.tokens for g in greedy_generate(native, prompts, 10)]


def test_fallback_conforms_to_the_model_kit(tmp_path):
    """The model kit (chunked prefill in mixed batches, a prefix-cache hit, decode) on a latent-
    attention model whose value heads are narrower than its query/key heads (padded in the pool)."""
    path = tiny_checkpoint("deepseek_v3", str(tmp_path), q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8,
                           qk_nope_head_dim=8, v_head_dim=16, head_dim=8, n_routed_experts=4, num_experts_per_tok=2,
                           moe_intermediate_size=32, n_group=1, topk_group=1, first_k_dense_replace=1,
                           # as in DeepSeek's own configs: MLA expands the latent to every head, and
                           # transformers' eager attention (the kit's reference) repeats KV heads by
                           # heads / num_key_value_heads
                           num_key_value_heads=4)
    check_model_parity(TransformersForCausalLM, path)


def test_a_tensor_missing_from_the_checkpoint_is_named_as_the_checkpoint_names_it(gpt2_dir, tmp_path):
    """Was: "left 1 parameter(s) unloaded: hf.transformer.h.1.mlp.c_proj.weight" (the wrapper's attribute)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copy(f"{gpt2_dir}/config.json", tmp_path / "config.json")
    weights = load_file(f"{gpt2_dir}/model.safetensors")
    del weights["transformer.h.1.mlp.c_proj.weight"]
    save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"left 1 parameter\(s\) of GPT2LMHeadModel unloaded: "
                                         r"transformer.h.1.mlp.c_proj.weight$") as e:
        _runner(str(tmp_path), "auto")
    assert "hf." not in str(e.value)


def test_selection_errors_name_the_option_and_the_package():
    reg = Registry.discover()
    with pytest.raises(PluginError, match="model.impl: transformers"):
        select_model(reg, "GPT2LMHeadModel", "native")
    without = Registry.discover(deny={"transformers"})
    without.skipped.pop("transformers")  # as if not installed at all
    with pytest.raises(PluginError, match="which is not installed: pip install radixserve-models-transformers"):
        select_model(without, "GPT2LMHeadModel", "auto")
    with pytest.raises(PluginError, match="model.impl: transformers needs"):
        select_model(without, "LlamaForCausalLM", "transformers")
    assert not select_model(without, "LlamaForCausalLM", "auto").fallback


@pytest.mark.parametrize("how", ["plugins.disable", "env", "allow-list"])
def test_a_disabled_fallback_is_named_disabled_not_missing(how, monkeypatch):
    """Was: `-p no:transformers` / RADIXSERVE_DISABLE_PLUGINS said "which is not installed: pip install ..."."""
    if how == "env":
        monkeypatch.setenv("RADIXSERVE_DISABLE_PLUGINS", "transformers")
    elif how == "allow-list":
        monkeypatch.setenv("RADIXSERVE_PLUGINS", "llama")
    reg = Registry.discover(deny={"transformers"} if how == "plugins.disable" else None)
    for arch, impl in (("GPT2LMHeadModel", "auto"), ("LlamaForCausalLM", "transformers")):
        with pytest.raises(PluginError) as e:
            select_model(reg, arch, impl)
        msg = str(e.value)
        assert "installed but not loaded" in msg and "not installed" not in msg and "pip install" not in msg, msg
        want = {"plugins.disable": "plugins.disable or a -p no:transformers flag; remove 'transformers' from it",
                "env": "the RADIXSERVE_DISABLE_PLUGINS environment variable; remove 'transformers' from it",
                "allow-list": "not in RADIXSERVE_PLUGINS llama; add 'transformers' to it"}[how]
        assert want in msg, msg


def test_config_rejects_an_unknown_impl_naming_it():
    with pytest.raises(ConfigError, match="model.impl.*'vllm'"):
        Config.build({"model": {"impl": "vllm"}})


def test_model_impl_flag_and_plugins_listing(capsys):
    from radixserve.cli import main, make_parser
    from radixserve.cli_serve import _flag_overrides

    args = make_parser().parse_args(["serve", "--model", "m", "--model-impl", "transformers"])
    assert _flag_overrides(args)["model"] == {"path": "m", "impl": "transformers"}
    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    assert "any AutoModelForCausalLM  fallback  radixserve-models-transformers" in out
    assert "LlamaForCausalLM" in out.split("model architectures")[1]


def test_windows_and_soft_capping_pass_through_to_the_backend(tmp_path):
    """Gemma 2 through the fallback: its sliding window (shorter than the prompts) and both soft-caps
    reach RadixServe's attention layer (plugin API 1.3), so the result matches transformers."""
    model_type, overrides = DENSE_CASES["gemma2-softcap-window"]
    check_model_parity(TransformersForCausalLM, tiny_checkpoint(model_type, str(tmp_path), **overrides))


@pytest.mark.parametrize("model_type, overrides, feature", [
    ("mamba", {"hidden_size": 32, "state_size": 4}, "no-attention-interface"),  # no attention at all
    ("gpt_oss", {"hidden_size": 64, "intermediate_size": 64, "head_dim": 16, "num_attention_heads": 4,
                 "num_key_value_heads": 2, "num_local_experts": 4}, "attention-feature"),  # attention sinks
])
def test_unsupported_features_are_named_before_any_weight_loads(model_type, overrides, feature):
    base = {"vocab_size": 128, "num_hidden_layers": 2, "decoder_layers": 2}
    cfg = AutoConfig.for_model(model_type, **{**base, **overrides})
    cfg.architectures = [AutoModelForCausalLM._model_mapping[type(cfg)].__name__]
    with pytest.raises(UnsupportedModelError) as err:
        TransformersForCausalLM(cfg)
    assert err.value.feature == feature
    # models audit 30: "the model never called transformers' attention interface" named no model or component
    assert str(err.value).startswith(f"{cfg.architectures[0]}: the transformers fallback (radixserve-models-transformers) "
                                     "cannot run it: "), str(err.value)


def test_forward_has_no_host_sync_so_it_can_be_graph_captured():
    """Every tensor lives on the meta device, so any `.item()`, `.tolist()` or branch on a tensor's
    value in the HF model or the attention function raises: the decode forward is capturable."""
    cfg = AutoConfig.for_model("llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                               rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                "original_max_position_embeddings": 64})
    cfg.architectures = ["LlamaForCausalLM"]
    with torch.device("meta"):
        model = TransformersForCausalLM(cfg)
    assert model.attention_dims() == (2, 4, 2, 16)
    logits = meta_decode_logits(model, heads=4, kv_heads=2, head_dim=16)
    assert logits.shape == (3, 256) and logits.device.type == "meta"


def test_cli_names_the_option_when_no_native_plugin_claims_the_model(gpt2_dir, capsys):
    from radixserve.cli import main

    assert main(["generate", "hi", "runtime.device=cpu", "--model", gpt2_dir, "--model-impl", "native"]) == 2
    err = capsys.readouterr().err
    assert "GPT2LMHeadModel" in err and "model.impl: transformers" in err and "Traceback" not in err


def test_an_architecture_typo_on_a_natively_served_model_type_says_how_to_run_it_natively(tmp_path, caplog):
    """Audit 30: `architectures: ["LlamaForCausalLMM"]` moved a Llama checkpoint onto the fallback with only the
    fallback's note that it runs LlamaForCausalLM instead; now the warning names the native plugin and the fix."""
    from radixserve.model_loader.sources import open_checkpoint

    path = tiny_checkpoint("llama", str(tmp_path / "ck"))
    config_file = tmp_path / "ck" / "config.json"
    config_file.write_text(config_file.read_text().replace('"LlamaForCausalLM"', '"LlamaForCausalLMM"'))
    cfg = Config.build({"model": {"path": path}})
    with caplog.at_level(logging.WARNING, logger="radixserve.model_loader.sources"):
        assert open_checkpoint(cfg, Registry.from_config(cfg)).choice.fallback
    [warning] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "names LlamaForCausalLMM" in warning and "the native plugin 'llama'" in warning
    assert "write LlamaForCausalLM into `architectures`" in warning
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="radixserve.model_loader.sources"):  # a real class: no warning
        open_checkpoint(Config.build({"model": {"path": path, "impl": "transformers"}}), Registry.from_config(cfg))
    assert not caplog.records


def test_a_wrong_shape_in_a_converted_layout_names_the_checkpoint_tensor_and_both_shapes(tmp_path):
    """Audit 31: a GraniteMoe tensor of the wrong shape (loaded through transformers' layout conversion) was
    "no matching parameter ... ('model.layers.1...experts.gate_up_proj', torch.Size([8, 66, 64]), ...)"."""
    import shutil

    from safetensors.torch import load_file, save_file

    src = tiny_checkpoint("granitemoe", str(tmp_path / "src"), num_hidden_layers=2, num_local_experts=4,
                          num_experts_per_tok=2)
    dst = tmp_path / "bad"
    shutil.copytree(src, dst)
    weights = load_file(f"{src}/model.safetensors")
    name = "model.layers.1.block_sparse_moe.input_linear.weight"
    experts, rows, cols = weights[name].shape
    weights[name] = torch.zeros(experts, rows + 2, cols)
    save_file(weights, str(dst / "model.safetensors"))
    with pytest.raises(ValueError) as e:
        _runner(str(dst), "transformers")
    message = str(e.value)
    assert f"(file model.safetensors): checkpoint tensor {name!r}" in message, message
    assert f"has shape {(experts, rows + 2, cols)}, the parameter of GraniteMoeForCausalLM {(experts, rows, cols)}" \
        in message, message
    assert "torch.Size" not in message and "no matching parameter" not in message
