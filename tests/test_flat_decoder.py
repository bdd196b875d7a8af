"""The flat decoder layer (radixserve.layers.flat_decoder): plain Llama layers on the CPU in fp32
run as one function each, over the same kernels in the same order as the layer modules, so the
logits are the same bits with it and without it: batch-1 and batch-16 decode, chunked prefill;
for a tiny Llama checkpoint (the core's fp32 linears) and SmolLM2 (the GGUF file dequantized,
and its kept blocks)."""

from __future__ import annotations

import pytest
import torch
from radixserve.config import Config
from radixserve.layers.decoder_blocks import PreNormDecoderLayer
from radixserve.layers.flat_decoder import FlatDecoderLayer
from radixserve.model_runner import ModelRunner
from runner_driver import greedy_generate


def _runner(path: str, options: dict | None = None) -> ModelRunner:
    return ModelRunner(Config.build({
        "model": {"path": path, "weight_source_options": options or {}},
        "runtime": {"device": "cpu", "dtype": "float32", "num_threads": 1},
        "scheduler": {"max_total_tokens": 4096, "max_running_requests": 16},
    }), show_progress=False)


def _layers(runner) -> list:
    return list(runner.model.model.layers)


def _module_calls(runner, run):
    """`run()` with every layer back on `PreNormDecoderLayer.forward` (the flat forward removed)."""
    layers = _layers(runner)
    saved = [layer.__dict__.pop("forward") for layer in layers]
    try:
        return run()
    finally:
        for layer, forward in zip(layers, saved, strict=True):
            layer.forward = forward


def _prompts(vocab: int, n: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 40, (n,), generator=gen).tolist()
    return [torch.randint(10, vocab, (k,), generator=gen).tolist() for k in lengths]


def _assert_same_bits(runner, seed: int, new_tokens: int) -> None:
    """Batch 16 and batch 1 (prefill + decode) and a chunked prefill: same tokens and logits, bit
    for bit, with the flat layers and with the module calls."""
    prompts = _prompts(runner.vocab_size, 16, seed)
    same_length = [[(t * 7 + i) % runner.vocab_size for t in range(17)] for i in range(2)]  # chunks: 5+5+5+2
    cases = [(prompts, None), (prompts[:1], None), (same_length, 5)]
    for batch, chunk in cases:
        flat = greedy_generate(runner, batch, new_tokens, keep_logits=True, prefill_chunk=chunk)
        modules = _module_calls(runner, lambda b=batch, c=chunk: greedy_generate(
            runner, b, new_tokens, keep_logits=True, prefill_chunk=c))
        for got, want in zip(flat, modules, strict=True):
            assert got.tokens == want.tokens, f"batch {len(batch)}, chunk {chunk}"
            assert all(torch.equal(a, b) for a, b in zip(got.logits, want.logits, strict=True)), \
                f"batch {len(batch)}, chunk {chunk}"


def test_tiny_llama_flat_layers_same_bits_as_module_calls(tiny_llama_dir):
    runner = _runner(tiny_llama_dir("llama"))
    assert all(isinstance(layer.forward, FlatDecoderLayer) for layer in _layers(runner))
    _assert_same_bits(runner, seed=3, new_tokens=6)
    assert all(layer.forward.bound not in (None, False) for layer in _layers(runner))  # the flat path ran


def test_layers_it_cannot_compute_keep_the_module_calls(tiny_llama_dir):
    """Qwen3's per-head q/k norm is not the plain layer: no flat forward is installed."""
    runner = _runner(tiny_llama_dir("qwen3"))
    assert not any("forward" in layer.__dict__ for layer in _layers(runner))


def test_flat_layer_hands_other_inputs_to_the_class_forward(tiny_llama_dir, monkeypatch):
    """A call the kernels do not take (a bf16 stream) goes to the class's forward, whose result it returns."""
    runner = _runner(tiny_llama_dir("llama"))
    greedy_generate(runner, _prompts(runner.vocab_size, 1, 0), 2)  # binds the flat forwards
    layer = _layers(runner)[0]
    calls = []
    monkeypatch.setattr(PreNormDecoderLayer, "forward", lambda self, *args: calls.append((self, args)) or "class")
    h = torch.zeros(2, layer.input_layernorm.weight.numel(), dtype=torch.bfloat16)
    assert layer.forward(torch.zeros(2, dtype=torch.long), h, None, None) == "class"
    assert len(calls) == 1 and calls[0][0] is layer and calls[0][1][1] is h


@pytest.mark.parametrize("dequantize", [True, "auto"], ids=["dequantized", "kept"])
def test_smollm2_gguf_flat_layers_same_bits_as_module_calls(smollm2_gguf_path, dequantize):
    runner = _runner(smollm2_gguf_path, {"dequantize": dequantize})
    assert all(isinstance(layer.forward, FlatDecoderLayer) for layer in _layers(runner))
    _assert_same_bits(runner, seed=5, new_tokens=3)
    assert all(layer.forward.bound not in (None, False) for layer in _layers(runner))
