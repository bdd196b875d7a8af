"""The parity sweep's fast subset (the full sweep is `python benchmarks/model_sweep.py`, which writes
docs/supported-models.md): a handful of architectures through RadixServe and transformers, each
classified; the enumeration comes from transformers' own auto mapping."""

from __future__ import annotations

import pytest
from radixserve.plugins.model_select import native_architectures
from radixserve.plugins.registry import Registry
from radixserve.testing import sweep

# model type -> (expected status, feature named in the reason or None)
FAST_SUBSET = {
    "llama": ("pass", None),          # a native plugin
    "gpt_neox": ("pass", None),       # fallback: partial rotary, parallel residual
    "gemma": ("pass", None),          # fallback: embedding scaling, offset norms
    "mixtral": ("pass", None),        # MoE: native once a plugin claims it, else the fallback
    "deepseek_v3": ("pass", None),    # latent attention (MLA): run on a backend that supports it
    "mamba": ("unsupported", "no-attention-interface"),
    "bart": ("pass", None),           # fallback: its position embedding counts from the input start otherwise
    "gemma3": ("skip", None),         # multimodal wrapper: its text model is gemma3_text
}


def test_architectures_come_from_transformers_auto_mapping():
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    archs = dict(sweep.causal_lm_architectures())
    assert archs.keys() == MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.keys()
    assert archs["llama"] == "LlamaForCausalLM" and len(archs) >= 150


@pytest.mark.parametrize("model_type", FAST_SUBSET)
def test_fast_subset(model_type, tmp_path):
    want, feature = FAST_SUBSET[model_type]
    r = sweep.run_one(model_type, str(tmp_path))
    assert r.status == want, r
    if feature:
        assert r.why.startswith(feature), r.why
    if r.status == "pass":  # the path the runner would take: a native plugin wherever one is installed
        native = r.architecture in native_architectures(Registry.discover())
        assert r.path.startswith("native") == native, r


def test_a_hung_architecture_is_a_classified_row_not_a_lost_sweep():
    (r,) = list(sweep.sweep(["gpt2"], timeout=0.2))
    assert (r.model_type, r.status) == ("gpt2", "ours") and "timed out" in r.why


def test_markdown_table_counts_and_rows():
    rows = [sweep.SweepResult("a", "AForCausalLM", "fallback", "pass", ""),
            sweep.SweepResult("b", "BForCausalLM", "native (x)", "pass", ""),
            sweep.SweepResult("c", "CForCausalLM", "fallback", "unsupported", "attention-softcap: soft|cap")]
    page = sweep.render_markdown(rows, "# title")
    assert "**2 architectures pass** (1 through a native plugin, 1 through the transformers fallback)" in page
    assert "| c | CForCausalLM | fallback | unsupported | attention-softcap: soft\\|cap |" in page
