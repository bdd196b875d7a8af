"""Quantized checkpoints through the runner: the method is picked from the checkpoint's
quantization_config (or stack.quantization for online fp8), served end to end on the CPU, and a
method that cannot run here is a start-up error naming what does."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch
from radixserve.config import Config
from radixserve.model_runner import ModelRunner
from radixserve.plugins.registry import PluginError, Registry
from runner_driver import greedy_generate

from tests import quant_fixtures as qf


def _runner(path: str, runtime: dict | None = None, **stack) -> ModelRunner:
    cfg = Config.build({
        "model": {"path": path},
        "stack": stack,
        "runtime": {"device": "cpu", "dtype": "float32", "num_threads": 1, **(runtime or {})},
        "scheduler": {"max_total_tokens": 1024, "max_running_requests": 4},
    })
    return ModelRunner(cfg, show_progress=False)


def _prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (6, 11)]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from radixserve.testing import tiny_checkpoint

    return tiny_checkpoint("llama", str(tmp_path_factory.mktemp("llama")), tie_word_embeddings=False,
                           **qf.TINY_QUANT_CONFIG)


@pytest.mark.parametrize("fmt,group_size,opts,kind", [
    ("awq", 64, {}, "AWQMethod"),
    ("gptq", 32, {"act_order": True}, "GPTQMethod"),
    ("fp8_block", 128, {}, "FP8Method"),
])
def test_checkpoint_quantization_config_picks_the_method(tiny_llama, tmp_path, fmt, group_size, opts, kind):
    quant, ref = str(tmp_path / "quant"), str(tmp_path / "ref")
    qf.write_quantized_checkpoint(tiny_llama, quant, ref, fmt, group_size, **opts)
    runner = _runner(quant)
    layer = runner.model.model.layers[0].self_attn.qkv_proj
    assert type(layer.quant_method).__name__ == kind
    if kind != "FP8Method":  # the checkpoint's packed tensors were replaced by the kernel layout
        assert not hasattr(layer, "qweight") and layer.int4_weight.qweight.dtype == torch.int32
    prompts = _prompts(runner.vocab_size)
    got = [g.tokens for g in greedy_generate(runner, prompts, 8)]
    want = [g.tokens for g in greedy_generate(_runner(ref), prompts, 8)]
    assert got == want


def test_online_fp8_from_the_stack(tiny_llama, tmp_path):
    """stack.quantization=fp8 on a float checkpoint: per-channel e4m3 weights; outputs equal the
    float model whose weights went through the same per-channel rounding (computed here)."""
    from safetensors.torch import load_file, save_file

    runner = _runner(tiny_llama, quantization="fp8")
    layer = runner.model.model.layers[1].mlp.down_proj
    assert layer.weight.dtype == torch.float8_e4m3fn
    weights = load_file(os.path.join(tiny_llama, "model.safetensors"))
    for name, w in weights.items():
        if name.split(".")[-2] in qf.DECODER_LINEARS:
            scale = (w.abs().amax(1, keepdim=True) / qf.FP8_MAX).clamp(min=1e-12)
            weights[name] = (w / scale).to(torch.float8_e4m3fn).float() * scale
    ref = tmp_path / "ref"
    ref.mkdir()
    save_file(weights, str(ref / "model.safetensors"), metadata={"format": "pt"})
    (ref / "config.json").write_text(open(os.path.join(tiny_llama, "config.json")).read())
    prompts = _prompts(runner.vocab_size)
    got = [g.tokens for g in greedy_generate(runner, prompts, 8)]
    assert got == [g.tokens for g in greedy_generate(_runner(str(ref)), prompts, 8)]


def test_unsupported_checkpoint_config_is_a_startup_error(tiny_llama, tmp_path):
    quant, ref = str(tmp_path / "quant"), str(tmp_path / "ref")
    qf.write_quantized_checkpoint(tiny_llama, quant, ref, "awq", 32)
    cfg_path = os.path.join(quant, "config.json")
    cfg = json.load(open(cfg_path))
    cfg["quantization_config"]["version"] = "gemv"
    json.dump(cfg, open(cfg_path, "w"))
    with pytest.raises(PluginError, match=r"quantization method 'awq' \(radixserve-quant-awq\): AWQ version='gemv'"):
        _runner(quant)


def test_method_without_the_device_names_the_devices_that_work():
    from radixserve.model_loader.quant_select import build_quant_method, chosen_quant_method
    from radixserve.plugins.stack import ResolvedStack

    reg = Registry.discover()
    spec = reg.get("quantization", "awq")
    reg._components[("quantization", "awq")] = dataclasses.replace(spec, devices=("cuda",))
    hf_config = type("Cfg", (), {"quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 128}})()
    stack = ResolvedStack(device="cpu", attention=None, prefix_cache=None, policy=None)
    with pytest.raises(PluginError, match="'awq' .* does not support device 'cpu': it runs on cuda"):
        build_quant_method(reg, chosen_quant_method(reg, stack, hf_config), torch.device("cpu"), torch.float32)


def test_gpu_below_the_minimum_capability_is_named(monkeypatch):
    """check_device: a GPU older than the method's min_capability is refused, naming both."""
    from radixserve_quant_fp8.method import FP8Method

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 0))
    with pytest.raises(ValueError, match=r"FP8Method needs a CUDA device of compute capability >= 8\.0; this one is 7\.0"):
        FP8Method().check_device(torch.device("cuda"), torch.bfloat16)
    FP8Method().check_device(torch.device("cpu"), torch.float32)  # the CPU fallback always runs


def test_lowbit_gemv_is_a_per_model_choice_made_through_the_method(tiny_llama, tmp_path, monkeypatch):
    # runtime.lowbit_gemv resolves per model (no process-wide switch): the loader asks each quantized
    # linear's method to prepare for the GEMVs only for a model whose key resolves on, and a second
    # model loaded with it off in the same process is untouched. On the CPU "auto" resolves off, so
    # the CUDA answer is stood in for; the int4 method then answers False for a CPU weight.
    from radixserve.layers import lowbit_gemv
    from radixserve_quant_awq.method import AWQMethod

    quant, ref = str(tmp_path / "quant"), str(tmp_path / "ref")
    qf.write_quantized_checkpoint(tiny_llama, quant, ref, "awq", 64)
    asked = []
    real = AWQMethod.enable_lowbit_gemv
    monkeypatch.setattr(AWQMethod, "enable_lowbit_gemv", lambda self, layer: asked.append(layer) or real(self, layer))
    monkeypatch.setattr(lowbit_gemv, "resolve", lambda mode, device: mode != "off")
    on = _runner(quant)
    layers = on.hf_config.num_hidden_layers
    assert len(asked) == 4 * layers  # qkv, o, gate_up, down of every layer
    assert all(layer.int4_weight.rows is None for layer in asked)  # CPU weights: no row-layout copy
    asked.clear()
    off = _runner(quant, runtime={"lowbit_gemv": "off"})
    assert asked == []
    prompts = _prompts(on.vocab_size)
    assert [g.tokens for g in greedy_generate(on, prompts, 4)] == [g.tokens for g in greedy_generate(off, prompts, 4)]
