"""The decoder-only shell a model plugin builds on (radixserve.layers.causal_lm, plugin API 1.4):
the family written in docs/plugin-authoring.md section 8 matches transformers as printed, and the
shared weight-loading loop names a tensor it cannot place."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from radixserve.layers.causal_lm import DecoderOnlyCausalLM
from radixserve.layers.weight_utils import load_stacked_weights
from radixserve.testing import check_model_parity

DOC = Path(__file__).resolve().parents[1] / "docs" / "plugin-authoring.md"


def _documented_family() -> type:
    """Execute the Python block of the docs section that defines `ExampleForCausalLM`."""
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    source = next(b for b in blocks if "class ExampleForCausalLM(DecoderOnlyCausalLM)" in b)
    namespace: dict = {}
    exec(compile(source, f"{DOC}:ExampleForCausalLM", "exec"), namespace)
    return namespace["ExampleForCausalLM"]


def test_the_documented_family_matches_transformers(tiny_llama_dir):
    model_cls = _documented_family()
    assert issubclass(model_cls, DecoderOnlyCausalLM)
    check_model_parity(model_cls, tiny_llama_dir("llama", tie_word_embeddings=False), prompt_lens=(5, 9), new_tokens=4)


def test_load_names_the_checkpoint_tensor_it_cannot_place(tiny_llama_dir):
    from radixserve_models_llama.model import LlamaForCausalLM
    from transformers import AutoConfig

    model = LlamaForCausalLM(AutoConfig.from_pretrained(tiny_llama_dir("llama", tie_word_embeddings=False)))
    weight = model.model.layers[0].self_attn.o_proj.weight
    with pytest.raises(KeyError, match=r"'model.layers.0.self_attn.extra_proj.weight'.*LlamaForCausalLM"):
        load_stacked_weights(model, [("model.layers.0.self_attn.extra_proj.weight", torch.zeros_like(weight))])
    # a recomputed rotary buffer and a tied head's weight are skipped, not an error
    model.tie_word_embeddings = True
    assert load_stacked_weights(model, [("model.layers.0.self_attn.rotary_emb.inv_freq", torch.zeros(4)),
                                        ("lm_head.weight", torch.zeros(1))]) == set()


def test_tiny_checkpoint_writes_only_the_fields_the_architecture_has(tmp_path):
    """GPT-NeoX has no num_key_value_heads, head_dim or rms_norm_eps: a tiny checkpoint that wrote them sized the
    KV pool for 2 KV heads under a 4-head attention and hid a plugin's missing-field bug (audit 34)."""
    import json

    from radixserve.testing import tiny_checkpoint

    neox = json.loads((Path(tiny_checkpoint("gpt_neox", str(tmp_path / "neox"))) / "config.json").read_text())
    assert not {"num_key_value_heads", "head_dim", "rms_norm_eps"} & set(neox)
    assert neox["hidden_size"] == 64 and neox["num_attention_heads"] == 4
    llama = json.loads((Path(tiny_checkpoint("llama", str(tmp_path / "llama"))) / "config.json").read_text())
    assert llama["num_key_value_heads"] == 2 and llama["head_dim"] == 16 and llama["rms_norm_eps"] == 1e-6


def _one_kv_head_model() -> type:
    from radixserve_models_llama.model import LlamaForCausalLM

    class OneKVHeadForCausalLM(LlamaForCausalLM):
        """Sizes the KV pool for one KV head while its layers (from the config) have two."""

        def attention_dims(self):
            c = self.config
            return c.num_hidden_layers, c.num_attention_heads, 1, c.head_dim

    return OneKVHeadForCausalLM


def test_attention_layers_that_disagree_with_the_kv_pool_are_named(tiny_llama_dir, tmp_path):
    """A model whose attention_dims() (or config) sizes the KV pool for other heads than its RadixAttention
    layers write: the kit and the runner name the layer, both counts and attention_dims(), before any step
    (it was a bare shape error inside the first KV write, audit 34)."""
    import sys
    import types

    from radixserve.config import Config
    from radixserve.model_runner import ModelRunner
    from radixserve.plugins.registry import Registry

    model_cls = _one_kv_head_model()
    message = r"attention layer model\.layers\.0\.self_attn\.attn has num_kv_heads 2 \(the pool has 1\).*attention_dims\(\)"
    with pytest.raises(ValueError, match=message):
        check_model_parity(model_cls, tiny_llama_dir("llama"), prompt_lens=(3,), new_tokens=1)

    path = tiny_llama_dir("llama", architectures=["OneKVHeadForCausalLM"])
    holder = types.ModuleType("one_kv_head_test_models")
    holder.OneKVHeadForCausalLM = model_cls
    plugin = types.ModuleType("one_kv_head_test_plugin")
    plugin.PLUGIN_API = ">=1,<2"
    plugin.radixserve_register = lambda registry: registry.register(
        "model", "OneKVHeadForCausalLM", "one_kv_head_test_models:OneKVHeadForCausalLM")
    sys.modules[holder.__name__] = holder
    try:
        cfg = Config.build({"model": {"path": path}, "runtime": {"device": "cpu", "dtype": "float32"},
                            "scheduler": {"max_total_tokens": 256}})
        registry = Registry.from_config(cfg)
        registry.add_plugin_module(plugin, name="one-kv-head", distribution="one-kv-head-test")
        with pytest.raises(ValueError, match=message):
            ModelRunner(cfg, registry=registry, show_progress=False)
    finally:
        del sys.modules[holder.__name__]
