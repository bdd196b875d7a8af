"""The transformers fallback and attention masks: a per-key score bias the model passes as its mask
(Doge's dynamic mask) is applied, not dropped; masks it cannot apply are refused by name; models
whose own code reads transformers' causal mask (DSA indexers, MPT) get it and are classified by what
they really need. Also the sweep's tiny configs for families whose defaults broke the shrinking."""

from __future__ import annotations

import pytest
import torch
from radixserve.testing import check_model_parity
from radixserve.testing.sweep import build_checkpoint, tiny_config
from radixserve_models_transformers.attention import UnsupportedModelError, _mask_kind
from radixserve_models_transformers.model import TransformersForCausalLM
from transformers import AutoConfig, AutoModelForCausalLM


def test_mask_kinds():
    causal = torch.ones(3, 3, dtype=torch.bool).tril()
    assert _mask_kind(None, 4, 2) is None
    assert _mask_kind(causal[None, None], 4, 2) is None  # transformers' causal mask: the backend does it
    low = torch.finfo(torch.float32).min
    assert _mask_kind(torch.zeros(3, 3).masked_fill(~causal, low)[None, None], 4, 2) is None
    bias = torch.randn(1, 2, 1, 3).repeat_interleave(2, dim=1).expand(1, 4, 3, 3)  # per KV head and key
    assert _mask_kind(bias, 4, 2) == "key_bias"
    assert "not a per-key bias" in _mask_kind(torch.randn(1, 4, 3, 3), 4, 2)  # varies per query
    assert "not a per-key bias" in _mask_kind(torch.randn(1, 4, 1, 3).expand(1, 4, 3, 3), 4, 2)  # per query head
    assert "not causal" in _mask_kind(torch.ones(1, 1, 3, 3, dtype=torch.bool), 4, 2)


def test_doge_dynamic_mask_bias_reaches_the_backend(tmp_path):
    """Doge adds a learned bias per head and key to the scores (passed as its attention mask); the
    fallback used to drop it (first-step logits 6e-2 off). It now travels in an extra q/k column."""
    path = str(tmp_path / "doge")
    build_checkpoint("doge", path)
    model = TransformersForCausalLM(AutoConfig.from_pretrained(path))
    assert all(b.key_bias for b in model.ctx.bindings)
    check_model_parity(TransformersForCausalLM, path)


def test_doge_with_real_dynamic_sparsity_is_refused_by_name():
    cfg = tiny_config("doge")
    cfg.keep_window_size = 16  # fewer keys than its context: real top-k sparsity
    cfg.architectures = ["DogeForCausalLM"]
    with pytest.raises(UnsupportedModelError) as err:
        TransformersForCausalLM(cfg)
    assert err.value.feature == "dynamic-mask-sparsity" and "keep_window_size" in str(err.value)


@pytest.mark.parametrize("model_type, feature, words", [
    # the indexer reads the causal mask itself; then the top-k key indices are what the backends lack
    ("deepseek_v32", "attention-feature", "sparse attention"),
    # MPT builds its mask with transformers and attends by hand (ALiBi)
    ("mpt", "no-attention-interface", "attention interface"),
])
def test_models_reading_the_mask_are_classified_by_what_they_need(model_type, feature, words):
    cfg = tiny_config(model_type)
    cfg.architectures = [AutoModelForCausalLM._model_mapping[type(cfg)].__name__]
    with pytest.raises(UnsupportedModelError) as err:  # used to be a TypeError on a None mask
        TransformersForCausalLM(cfg)
    assert err.value.feature == feature and words in str(err.value)


@pytest.mark.parametrize("model_type, check", [
    ("zaya", lambda c: c.num_experts_per_tok == 1),  # the family routes to one expert only
    ("mamba2", lambda c: c.num_heads * c.head_dim == c.hidden_size * c.expand),
    ("xlnet", lambda c: c.d_model == 64),  # its max_position_embeddings setter refuses any value
    ("xmod", lambda c: c.default_language == c.languages[0]),
    ("gemma3n_text", lambda c: c.num_kv_shared_layers == 1),
    ("blt", lambda c: c.global_config.hidden_size == 64 and c.encoder_config.num_key_value_heads == 4),
])
def test_sweep_tiny_configs_build(model_type, check):
    cfg = tiny_config(model_type)
    assert check(cfg)
    with torch.device("meta"):
        AutoModelForCausalLM.from_config(cfg)
