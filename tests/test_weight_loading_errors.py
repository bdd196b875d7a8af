"""Checkpoints the native loader must refuse, each with one line naming what is wrong: a fused
parameter missing a shard (every family on the shared stacked loader), a tensor whose shape its
parameter cannot take (naming tensor, shapes, parameter and file), a tensor that maps to no
parameter (a ValueError, one CLI line, not a KeyError traceback)."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from family_cases import DENSE_CASES, MOE_CASES
from plugin_fixtures import run_cli
from radixserve.layers.weight_utils import load_stacked_weights
from radixserve.model_loader.loader import load_model
from radixserve.model_loader.sources import ModelSource
from radixserve.plugins.registry import Registry
from radixserve.testing import tiny_checkpoint
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

CHECKPOINTS = {  # name: (model_type, config overrides, architecture)
    "llama": ("llama", dict(tie_word_embeddings=False), "LlamaForCausalLM"),
    "qwen2": ("qwen2", dict(tie_word_embeddings=False), "Qwen2ForCausalLM"),
    "gemma2": (*DENSE_CASES["gemma2-softcap-window"], "Gemma2ForCausalLM"),
    "olmo2": (*DENSE_CASES["olmo2-qknorm-postnorm"], "Olmo2ForCausalLM"),
    "qwen2_moe": (*MOE_CASES["Qwen2MoeForCausalLM"], "Qwen2MoeForCausalLM"),
    "mixtral": (*MOE_CASES["MixtralForCausalLM"], "MixtralForCausalLM"),
    "deepseek_v2": ("deepseek_v2", {}, "DeepseekV2ForCausalLM"),
}

# (checkpoint, the tensor left out, the fused parameter it fills)
MISSING_SHARDS = {
    "llama-up": ("llama", "model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.gate_up_proj.weight"),
    "llama-k": ("llama", "model.layers.1.self_attn.k_proj.weight", "model.layers.1.self_attn.qkv_proj.weight"),
    "qwen2-v-bias": ("qwen2", "model.layers.0.self_attn.v_proj.bias", "model.layers.0.self_attn.qkv_proj.bias"),
    "gemma2-gate": ("gemma2", "model.layers.1.mlp.gate_proj.weight", "model.layers.1.mlp.gate_up_proj.weight"),
    "olmo2-q": ("olmo2", "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.qkv_proj.weight"),
    "qwen2_moe-shared-up": ("qwen2_moe", "model.layers.1.mlp.shared_expert.up_proj.weight",
                            "model.layers.1.mlp.shared_expert.gate_up_proj.weight"),
    "qwen2_moe-expert-up": ("qwen2_moe", "model.layers.1.mlp.experts.2.up_proj.weight",
                            "model.layers.1.mlp.experts.w13_weight"),
    "mixtral-expert-down": ("mixtral", "model.layers.0.block_sparse_moe.experts.1.w2.weight",
                            "model.layers.0.block_sparse_moe.experts.w2_weight"),
    "deepseek_v2-dense-up": ("deepseek_v2", "model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.gate_up_proj.weight"),
    "deepseek_v2-shared-gate": ("deepseek_v2", "model.layers.1.mlp.shared_experts.gate_proj.weight",
                                "model.layers.1.mlp.shared_experts.gate_up_proj.weight"),
}


@pytest.fixture(scope="module")
def registry() -> Registry:
    return Registry.discover()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    cache: dict[str, str] = {}

    def get(name: str) -> str:
        if name not in cache:
            model_type, overrides, _ = CHECKPOINTS[name]
            cache[name] = tiny_checkpoint(model_type, str(tmp_path_factory.mktemp(name)), **overrides)
        return cache[name]

    return get


def _edited(src: str, dst, edit) -> str:
    """A copy of checkpoint `src` whose tensors `edit(dict)` changed."""
    shutil.copytree(src, dst)
    weights = load_file(f"{dst}/model.safetensors")
    edit(weights)
    save_file(weights, f"{dst}/model.safetensors")
    return str(dst)


def _load(registry, path: str, arch: str):
    return load_model(ModelSource(path=path, format="safetensors"), AutoConfig.from_pretrained(path),
                      registry.load("model", arch), torch.device("cpu"), torch.float32, show_progress=False)


@pytest.mark.parametrize("case", sorted(MISSING_SHARDS))
def test_a_fused_parameter_missing_a_shard_is_named(registry, checkpoint, tmp_path, case):
    """Was: the fused parameter counted as loaded after its first shard, so the model ran with
    the missing shard's rows uninitialised (exit 0, garbage text); experts were reported only as
    a whole parameter left unloaded."""
    name, tensor, param = MISSING_SHARDS[case]
    path = _edited(checkpoint(name), tmp_path / "ckpt", lambda w: w.pop(tensor))
    with pytest.raises(ValueError) as e:
        _load(registry, path, CHECKPOINTS[name][2])
    assert re.search(rf"{re.escape(param)}: .*never loaded .*{re.escape(repr(tensor))}", str(e.value)), str(e.value)


def test_a_complete_checkpoint_still_loads_every_fused_parameter(registry, checkpoint):
    model = _load(registry, checkpoint("qwen2_moe"), "Qwen2MoeForCausalLM")
    assert model.model.layers[1].mlp.experts.partly_loaded_parts() == {}


def _cut(name: str, rows: int | None = None, cols: int | None = None):
    """An edit keeping the first `rows` rows / `cols` columns of tensor `name`."""
    def edit(w):
        t = w[name][:rows]
        w[name] = (t if cols is None else t[:, :cols]).contiguous()
    return edit


SHAPES = {  # case: (checkpoint, edit, checkpoint tensor, its shape now, the parameter, the parameter's shape)
    "narrower": ("llama", _cut("model.layers.1.mlp.down_proj.weight", cols=120), "model.layers.1.mlp.down_proj.weight",
                 (64, 120), "model.layers.1.mlp.down_proj.weight", (64, 128)),
    # was loaded silently: the first 128 columns of 256
    "wider": ("llama", lambda w: w.update({"model.layers.1.mlp.down_proj.weight":
                                           torch.cat([w["model.layers.1.mlp.down_proj.weight"]] * 2, 1)}),
              "model.layers.1.mlp.down_proj.weight", (64, 256), "model.layers.1.mlp.down_proj.weight", (64, 128)),
    "qkv-shard": ("llama", _cut("model.layers.1.self_attn.k_proj.weight", rows=16),
                  "model.layers.1.self_attn.k_proj.weight", (16, 64), "model.layers.1.self_attn.qkv_proj.weight",
                  (128, 64)),
    "gemma-norm": ("gemma2", _cut("model.layers.0.input_layernorm.weight", rows=32),
                   "model.layers.0.input_layernorm.weight", (32,), "model.layers.0.input_layernorm.weight", (64,)),
    "expert": ("qwen2_moe", _cut("model.layers.1.mlp.experts.1.up_proj.weight", rows=16),
               "model.layers.1.mlp.experts.1.up_proj.weight", (16, 64), "model.layers.1.mlp.experts.w13_weight",
               (4, 64, 64)),
}


@pytest.mark.parametrize("case", sorted(SHAPES))
def test_a_shape_mismatch_names_tensor_parameter_shapes_and_file(registry, checkpoint, tmp_path, case):
    """Was: "shard 0: expected 96 rows, got 128" or torch's "start (0) + length (128) exceeds
    dimension size (120)" (a RuntimeError traceback), naming neither tensor nor parameter."""
    name, edit, tensor, shape, param, param_shape = SHAPES[case]
    path = _edited(checkpoint(name), tmp_path / "ckpt", edit)
    with pytest.raises(ValueError) as e:
        _load(registry, path, CHECKPOINTS[name][2])
    text = str(e.value)
    for piece in (repr(path), "(file model.safetensors)", repr(tensor), str(shape), repr(param), str(param_shape)):
        assert piece in text, (piece, text)
    assert isinstance(e.value.__cause__, ValueError)  # the loader's error, kept


def test_the_file_named_is_the_shard_holding_the_tensor(registry, checkpoint, tmp_path):
    src = checkpoint("llama")
    weights = load_file(f"{src}/model.safetensors")
    weights["model.layers.1.mlp.down_proj.weight"] = weights["model.layers.1.mlp.down_proj.weight"][:, :120].clone()
    names = sorted(weights)
    files = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
             "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    assert "model.layers.1.mlp.down_proj.weight" in files["model-00002-of-00002.safetensors"]
    shutil.copy(f"{src}/config.json", tmp_path / "config.json")
    for file, keys in files.items():
        save_file({k: weights[k].contiguous() for k in keys}, str(tmp_path / file))
    index = {"weight_map": {k: f for f, keys in files.items() for k in keys}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"\(file model-00002-of-00002\.safetensors\): checkpoint tensor "
                                         r"'model\.layers\.1\.mlp\.down_proj\.weight' has shape \(64, 120\)"):
        _load(registry, str(tmp_path), "LlamaForCausalLM")


def test_an_unknown_tensor_is_a_value_error_and_still_a_key_error(registry, checkpoint, tmp_path):
    from radixserve.layers.weight_utils import UnknownCheckpointTensorError

    extra = "model.layers.0.mlp.extra_gate.weight"
    path = _edited(checkpoint("llama"), tmp_path / "ckpt", lambda w: w.update({extra: torch.zeros(3)}))
    with pytest.raises(ValueError, match=rf"'{re.escape(extra)}' has no matching parameter in LlamaForCausalLM"):
        _load(registry, path, "LlamaForCausalLM")
    model = registry.load("model", "LlamaForCausalLM")(AutoConfig.from_pretrained(path))
    with pytest.raises(UnknownCheckpointTensorError) as e:
        load_stacked_weights(model, [(extra, torch.zeros(3))])
    assert isinstance(e.value, KeyError) and str(e.value).startswith("checkpoint tensor")  # not KeyError's repr


def test_an_expert_tensor_on_a_model_without_expert_names_names_the_cause(registry, checkpoint):
    """Audit 31: a MoE model that left `expert_names` unset got only "... has no matching parameter in X"."""
    base = registry.load("model", "MixtralForCausalLM")

    class NoExpertNames(base):
        expert_names = None

    path = checkpoint("mixtral")
    with pytest.raises(ValueError, match=r"experts\.0\.w1\.weight' has no matching parameter in NoExpertNames.*"
                                         r"FusedMoE layers but no `expert_names`"):
        load_model(ModelSource(path=path, format="safetensors"), AutoConfig.from_pretrained(path), NoExpertNames,
                   torch.device("cpu"), torch.float32, show_progress=False)


def test_a_renamed_tensor_says_what_it_was_looked_up_as(registry, checkpoint):
    base = registry.load("model", "LlamaForCausalLM")

    class Renames(base):
        def rename_checkpoint_name(self, name: str) -> str:
            return name.replace("post_attention_layernorm", "post_attn_norm")

    path = checkpoint("llama")
    with pytest.raises(ValueError, match=r"'model.layers.0.post_attention_layernorm.weight' has no matching parameter "
                                         r"in Renames \(looked up as 'model.layers.0.post_attn_norm.weight'\)"):
        load_model(ModelSource(path=path, format="safetensors"), AutoConfig.from_pretrained(path), Renames,
                   torch.device("cpu"), torch.float32, show_progress=False)


def test_a_plugins_own_key_error_comes_back_as_one_value_error(registry, checkpoint):
    """A model whose own load_weights raises KeyError (what the Model contract named first)."""
    base = registry.load("model", "LlamaForCausalLM")

    class OwnLoader(base):
        def load_weights(self, weights):
            raise KeyError("checkpoint tensor 'x.weight' has no parameter in OwnLoader")

    path = checkpoint("llama")
    with pytest.raises(ValueError) as e:
        load_model(ModelSource(path=path, format="safetensors"), AutoConfig.from_pretrained(path), OwnLoader,
                   torch.device("cpu"), torch.float32, show_progress=False)
    assert str(e.value) == f"checkpoint {path!r}: checkpoint tensor 'x.weight' has no parameter in OwnLoader"


def test_the_fallback_names_an_unknown_tensor_as_a_value_error(tmp_path):
    from radixserve_models_transformers.model import TransformersForCausalLM

    src = tiny_checkpoint("gpt2", str(tmp_path / "gpt2"), bos_token_id=1, eos_token_id=2)
    path = _edited(src, tmp_path / "ckpt", lambda w: w.update({"transformer.h.0.extra.weight": torch.zeros(3)}))
    with pytest.raises(ValueError, match=r"\(file model\.safetensors\): .*transformer\.h\.0\.extra\.weight"):
        load_model(ModelSource(path=path, format="safetensors"), AutoConfig.from_pretrained(path),
                   TransformersForCausalLM, torch.device("cpu"), torch.float32, show_progress=False)


@pytest.mark.parametrize("case", ["unknown", "shape", "missing-shard"])
def test_the_cli_reports_each_load_error_as_one_line(checkpoint, tmp_path, case):
    """Was: the unknown tensor's KeyError gave a traceback and exit 1; shapes a RuntimeError traceback."""
    from radixserve.testing import tiny_tokenizer

    edits = {"unknown": lambda w: w.update({"model.layers.0.mlp.extra_gate.weight": torch.zeros(3)}),
             "shape": _cut("model.layers.1.mlp.down_proj.weight", cols=120),
             "missing-shard": lambda w: w.pop("model.layers.0.mlp.up_proj.weight")}
    path = _edited(checkpoint("llama"), tmp_path / "ckpt", edits[case])
    tiny_tokenizer().save_pretrained(path)
    r = run_cli(["generate", "--model", path, "--no-chat", "--max-tokens", "1", "hi"])
    errors = [line for line in r.stderr.splitlines() if line.startswith("radixserve: error:")]
    assert r.returncode == 2 and len(errors) == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert f"checkpoint {path!r}" in errors[0]


def test_an_unknown_shard_id_is_named_with_the_ids_the_layer_takes(registry, checkpoint):
    """A stacked mapping that sends `.k_proj.` as shard 'kk': the error names the tensor, the parameter and the
    ids QKVParallelLinear takes (audit 34: it was a bare `checkpoint '...': kk`)."""
    base = registry.load("model", "LlamaForCausalLM")

    class WrongShard(base):
        stacked_params_mapping = tuple((hf, ours, "kk" if sid == "k" else sid)
                                       for hf, ours, sid in base.stacked_params_mapping)

    path = checkpoint("llama")
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.self_attn\.k_proj\.weight'.*'model\.layers\.0\.self_attn"
                                         r"\.qkv_proj\.weight'.*unknown shard id 'kk': QKVParallelLinear takes 'q', "
                                         r"'k', 'v', 0, 1, 2"):
        load_model(ModelSource(path=path, format="safetensors"), AutoConfig.from_pretrained(path), WrongShard,
                   torch.device("cpu"), torch.float32, show_progress=False)


def test_a_model_constructor_bug_is_one_line_naming_the_model(registry, checkpoint):
    """Audit 34: a model reading a config field the config lacks gave a raw 34-line AttributeError traceback;
    a ValueError (the contract's refusal of a config) still goes through as it is."""
    from radixserve.plugins.registry import PluginCodeError

    base = registry.load("model", "LlamaForCausalLM")

    class ReadsMissingField(base):
        def __init__(self, config, *args, **kwargs):
            _ = config.layer_norm_epsilon  # a GPT-2 field: Llama configs have none
            super().__init__(config, *args, **kwargs)

    class Refuses(base):
        def __init__(self, config, *args, **kwargs):
            raise ValueError("unsupported hidden_act 'relu'")

    path = checkpoint("llama")
    label = "architecture LlamaForCausalLM: native plugin 'toy' (toy-dist 0.1)"
    with pytest.raises(PluginCodeError, match=r"^architecture LlamaForCausalLM: native plugin 'toy' \(toy-dist 0\.1\) "
                                              r"failed while building the model: AttributeError: .*layer_norm_epsilon"):
        load_model(ModelSource(path=path, format="safetensors"), AutoConfig.from_pretrained(path), ReadsMissingField,
                   torch.device("cpu"), torch.float32, show_progress=False, model_label=label)
    with pytest.raises(ValueError, match=r"^unsupported hidden_act 'relu'$"):
        load_model(ModelSource(path=path, format="safetensors"), AutoConfig.from_pretrained(path), Refuses,
                   torch.device("cpu"), torch.float32, show_progress=False, model_label=label)


@pytest.mark.parametrize("damage", ["truncated", "header", "missing-shard-file"])
def test_a_damaged_safetensors_file_is_one_line_naming_it(checkpoint, tmp_path, damage):
    """Was: safetensors' own SafetensorError (a cut download, a garbled header) or the OSError of a shard
    file the index names but the directory lacks, as a traceback from inside the loader."""
    from radixserve.testing import tiny_tokenizer

    path = tmp_path / "ckpt"
    shutil.copytree(checkpoint("llama"), path)
    tiny_tokenizer().save_pretrained(path)
    weights = path / "model.safetensors"
    if damage == "truncated":
        data = weights.read_bytes()
        weights.write_bytes(data[: len(data) // 2])
    elif damage == "header":
        weights.write_bytes(b"\xff" * 16 + weights.read_bytes()[16:])
    else:
        names = list(load_file(weights))
        (path / "model.safetensors.index.json").write_text(json.dumps(
            {"weight_map": {name: ("model-00001-of-00002.safetensors" if i % 2 else "model.safetensors")
                            for i, name in enumerate(names)}}))
    shown = "model-00001-of-00002.safetensors" if damage == "missing-shard-file" else "model.safetensors"
    r = run_cli(["generate", "--model", str(path), "--no-chat", "--max-tokens", "1", "hi"])
    errors = [line for line in r.stderr.splitlines() if line.startswith("radixserve: error:")]
    assert r.returncode == 2 and len(errors) == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert f"{shown}' is not a readable safetensors file" in errors[0], errors[0]
