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
