"""The transformers fallback's fused fast path (radixserve_models_transformers.fused): known modules
are swapped for RadixServe's fused layers and still match transformers; unknown or variant modules
(and table entries whose numeric self-check fails) keep transformers' own module; fused parameters
load from the checkpoint's unfused tensors."""

from __future__ import annotations

import logging

import pytest
import torch
from meta_decode import meta_decode_logits
from radixserve.testing import check_model_parity, tiny_checkpoint
from radixserve_models_transformers import fused
from radixserve_models_transformers.fused import FusedGatedMLP, FusedQKVAttention, FusedRMSNorm, rotate
from radixserve_models_transformers.model import TransformersForCausalLM
from radixserve_models_transformers.weights import load_hf_weights
from transformers import AutoConfig
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
from triton_interpret import round_bf16_like_gpu


def _config(path: str):
    return AutoConfig.from_pretrained(path)


def test_llama_like_checkpoint_runs_fused_layers_and_matches_transformers(tiny_llama_dir, caplog):
    """Llama with q/k/v/o and MLP biases (the biases are fused and sharded too)."""
    path = tiny_llama_dir("llama", attention_bias=True, mlp_bias=True)
    with caplog.at_level(logging.INFO, logger="radixserve_models_transformers.model"):
        model = TransformersForCausalLM(_config(path))
    layer = model.hf.model.layers[0]
    assert isinstance(layer.self_attn, FusedQKVAttention) and isinstance(layer.mlp, FusedGatedMLP)
    assert isinstance(layer.input_layernorm, FusedRMSNorm) and isinstance(model.hf.model.norm, FusedRMSNorm)
    names = dict(model.named_parameters())
    assert "hf.model.layers.0.self_attn.qkv_proj.bias" in names and "hf.model.layers.0.mlp.gate_up_proj.bias" in names
    assert not any(n.endswith(("q_proj.weight", "gate_proj.weight")) for n in names)
    message = next(r.getMessage() for r in caplog.records if "fused layers" in r.getMessage())
    assert "2 LlamaAttention -> qkv GEMM + rotary kernel" in message and "5 LlamaRMSNorm -> RMSNorm kernel" in message
    check_model_parity(TransformersForCausalLM, path)


def test_sliding_window_attention_keeps_its_window_when_fused(tiny_llama_dir):
    """Mistral passes its config's sliding window to the attention function: the fused module too."""
    path = tiny_llama_dir("mistral", sliding_window=6)
    model = TransformersForCausalLM(_config(path))
    assert isinstance(model.hf.model.layers[1].self_attn, FusedQKVAttention)
    assert model.hf.model.layers[1].self_attn.extra_kwargs == {"sliding_window": 6}
    check_model_parity(TransformersForCausalLM, path, prompt_lens=(9, 3))


def test_variant_norms_keep_their_module_and_still_match_transformers(tmp_path, monkeypatch, caplog):
    """Gemma's RMSNorm scales by (1 + weight) and its MLP is GELU-gated. Not in the tables, they
    are left alone; listed by mistake, the self-check on a random input catches both."""
    from transformers.models.gemma.modeling_gemma import GemmaMLP, GemmaRMSNorm

    path = tiny_checkpoint("gemma", str(tmp_path))
    model = TransformersForCausalLM(_config(path))
    assert isinstance(model.hf.model.layers[0].input_layernorm, GemmaRMSNorm)
    monkeypatch.setattr(fused, "RMSNORM_CLASSES", fused.RMSNORM_CLASSES | {"GemmaRMSNorm"})
    monkeypatch.setattr(fused, "GATED_MLP_CLASSES", fused.GATED_MLP_CLASSES | {"GemmaMLP"})
    with caplog.at_level(logging.INFO, logger="radixserve_models_transformers"):
        model = TransformersForCausalLM(_config(path))
    layer = model.hf.model.layers[0]
    assert isinstance(layer.input_layernorm, GemmaRMSNorm) and isinstance(layer.mlp, GemmaMLP)
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "2 GemmaMLP (act_fn " in text  # GELU-gated: not the SiLU the fused activation computes
    assert "5 GemmaRMSNorm (self-check mismatch)" in text
    check_model_parity(TransformersForCausalLM, path)


@pytest.fixture
def bf16_rounding_like_gpu():
    """Triton's CPU interpreter truncates fp32 -> bf16; a GPU rounds to nearest even (as torch)."""
    undo = round_bf16_like_gpu()
    yield
    undo()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_rotary_kernel_equals_transformers_rotary_bitwise(dtype, bf16_rounding_like_gpu):
    """The fused attention's one-launch rotary (Triton, interpreted here) on q/k sliced from one
    qkv output gives exactly transformers' apply_rotary_pos_emb."""
    n, hq, hkv, d = 7, 4, 2, 16
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(1, n, (hq + 2 * hkv) * d, generator=gen).to(dtype)
    q, k, _ = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    angles = torch.randn(1, n, d // 2, generator=gen) * 50
    cos, sin = (f(torch.cat((angles, angles), -1)).to(dtype) for f in (torch.cos, torch.sin))
    want_q, want_k = apply_rotary_pos_emb(q.view(1, n, hq, d).transpose(1, 2), k.view(1, n, hkv, d).transpose(1, 2),
                                          cos, sin)
    for kernel in (True, False):
        got_q, got_k = rotate(q, k, cos, sin, d, kernel=kernel)
        assert torch.equal(got_q.transpose(1, 2), want_q) and torch.equal(got_k.transpose(1, 2), want_k), kernel


def test_fused_parameters_load_from_unfused_tensors_and_only_when_complete(tiny_llama_dir):
    from safetensors.torch import load_file

    path = tiny_llama_dir("llama")
    model = TransformersForCausalLM(_config(path))
    state = load_file(f"{path}/model.safetensors")
    loaded = load_hf_weights(model.hf, state.items(), model._shards)
    assert loaded == set(dict(model.hf.named_parameters()))
    gate_up = model.hf.model.layers[1].mlp.gate_up_proj.weight
    assert torch.equal(gate_up, torch.cat([state["model.layers.1.mlp.gate_proj.weight"],
                                           state["model.layers.1.mlp.up_proj.weight"]]))
    partial = {k: v for k, v in state.items() if k != "model.layers.1.self_attn.v_proj.weight"}
    assert "model.layers.1.self_attn.qkv_proj.weight" not in load_hf_weights(model.hf, partial.items(), model._shards)
    bad = {**state, "model.layers.0.self_attn.k_proj.weight": torch.zeros(3, 3)}
    with pytest.raises(ValueError, match="model.layers.0.self_attn.k_proj.weight"):
        load_hf_weights(model.hf, bad.items(), model._shards)


def test_fused_forward_has_no_host_sync_so_it_can_be_graph_captured(tiny_llama_dir):
    """The fused model moved to the meta device after construction: any `.item()` or branch on a
    tensor's value in the fused modules would raise (the graph-safety check the unfused path has)."""
    model = TransformersForCausalLM(_config(tiny_llama_dir("llama")))
    assert isinstance(model.hf.model.layers[0].self_attn, FusedQKVAttention)
    model.to("meta")
    logits = meta_decode_logits(model, heads=4, kv_heads=2, head_dim=16)
    assert logits.shape == (3, 512) and logits.device.type == "meta"


def test_the_fused_layers_line_is_logged_when_nothing_is_fused(tmp_path, caplog):
    """Was: no line at all for GPT-2, OPT, GPT-NeoX (nothing in the tables), though the docs say one
    INFO line tells what was replaced."""
    path = tiny_checkpoint("gpt2", str(tmp_path), bos_token_id=1, eos_token_id=2)
    with caplog.at_level(logging.INFO, logger="radixserve_models_transformers.model"):
        TransformersForCausalLM(_config(path))
    lines = [r.getMessage() for r in caplog.records if "fused layers" in r.getMessage()]
    assert lines == ["transformers fallback GPT2LMHeadModel: replaced 0 module(s) with fused layers: none (no module "
                     "of a class in the fused-layer tables: transformers' own modules run)"], lines
    with caplog.at_level(logging.INFO, logger="radixserve_models_transformers.model"), torch.device("meta"):
        TransformersForCausalLM(_config(path))
    assert any("replaced 0 modules with fused layers (meta device" in r.getMessage() for r in caplog.records)


def test_a_checkpoint_naming_a_class_transformers_lacks_is_warned_about(tiny_llama_dir, caplog):
    """AutoModelForCausalLM builds from model_type: a plugin's own architecture name (its plugin
    uninstalled) runs as transformers' class for that model_type; was silent."""
    path = tiny_llama_dir("llama", architectures=["MyLlamaForCausalLM"])
    with caplog.at_level(logging.INFO, logger="radixserve_models_transformers.model"):
        model = TransformersForCausalLM(_config(path))
    assert type(model.hf).__name__ == "LlamaForCausalLM"
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("MyLlamaForCausalLM is not a transformers class; running LlamaForCausalLM" in m and "'llama'" in m
               for m in warned), warned
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="radixserve_models_transformers.model"):
        TransformersForCausalLM(_config(tiny_llama_dir("llama")))
    assert not any("the class transformers maps" in r.getMessage() for r in caplog.records)
