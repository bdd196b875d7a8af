"""Native dense families beyond Llama (Gemma 2, Gemma 3 text, Phi-3, OLMo 2) and sliding-window
Mistral: parity with transformers through the model conformance kit on tiny random checkpoints
whose sliding windows are shorter than the test sequences (a model or backend that ignores the
window, or the soft-capping, fails), and the runner around windowed models: no context capping,
every CPU backend, an unsupported backend refused by name."""

from __future__ import annotations

import pytest
import torch
from family_cases import DENSE_CASES as CASES
from family_cases import WINDOW
from hf_reference import hf_greedy
from radixserve.config import Config
from radixserve.model_runner import ModelRunner
from radixserve.plugins.registry import Registry
from radixserve.testing import ReferenceAttentionBackend, check_model_parity, tiny_checkpoint
from runner_driver import greedy_generate
from transformers import AutoConfig, AutoModelForCausalLM


@pytest.fixture(scope="module")
def registry() -> Registry:
    return Registry.discover()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    cache: dict[str, str] = {}

    def get(case: str) -> str:
        if case not in cache:
            model_type, overrides = CASES[case]
            cache[case] = tiny_checkpoint(model_type, str(tmp_path_factory.mktemp(case)), **overrides)
        return cache[case]

    return get


def _model_cls(registry, path: str):
    return registry.load("model", AutoConfig.from_pretrained(path).architectures[0])


@pytest.mark.parametrize("case", sorted(CASES))
def test_family_matches_transformers(registry, checkpoints, case):
    """The model conformance kit (chunked prefill in mixed batches, a prefix-cache hit, decode)."""
    path = checkpoints(case)
    check_model_parity(_model_cls(registry, path), path, prompt_lens=(5, 13, 2), new_tokens=12)


class _IgnoresLayerOptions(ReferenceAttentionBackend):
    """Exact attention that drops the layer's window and soft-cap (what a backend without them computes)."""

    def attend64(self, q, k, v, layer, batch):
        return super().attend64(q, k, v, _Plain(layer), batch)


class _Plain:
    def __init__(self, layer) -> None:
        self.layer_id, self.num_heads, self.num_kv_heads = layer.layer_id, layer.num_heads, layer.num_kv_heads
        self.head_dim, self.scaling = layer.head_dim, layer.scaling
        self.sliding_window = self.logit_cap = None


@pytest.mark.parametrize("case", ["gemma2-softcap-window", "mistral-window"])
def test_parity_needs_the_window_and_the_caps(registry, checkpoints, case):
    """The tiny configs really exercise the options: full, uncapped attention breaks parity."""
    path = checkpoints(case)
    with pytest.raises(AssertionError, match="differ from transformers|top 5"):
        check_model_parity(_model_cls(registry, path), path, prompt_lens=(13,), new_tokens=4,
                           attention=_IgnoresLayerOptions)


def test_layers_get_their_window_cap_and_rope(registry, checkpoints):
    from radixserve.layers.attention import RadixAttention

    path = checkpoints("gemma3-text-local-rope")
    cfg = AutoConfig.from_pretrained(path)
    model = _model_cls(registry, path)(cfg)
    attn = [m for m in model.modules() if isinstance(m, RadixAttention)]
    assert [(a.sliding_window, a.logit_cap) for a in attn] == [(WINDOW, None), (None, None)]  # Gemma 3: no attn cap
    local, full = (layer.self_attn.rotary_emb for layer in model.model.layers)
    assert local.inv_freq[1] > full.inv_freq[1]  # the local base (100) rotates faster than the global one
    path = checkpoints("gemma2-softcap-window")
    model = _model_cls(registry, path)(AutoConfig.from_pretrained(path))
    attn = [m for m in model.modules() if isinstance(m, RadixAttention)]
    assert [(a.sliding_window, a.logit_cap) for a in attn] == [(WINDOW, 1.0), (None, 1.0)]


def test_longrope_switches_to_the_long_factors_past_the_original_length(checkpoints):
    """Per position: short factors below original_max_position_embeddings (checked by parity above),
    transformers' long-factor frequencies and attention factor from there on."""
    from radixserve.interfaces.model import head_dim_of
    from radixserve_models_phi3.model import phi3_rope
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = AutoConfig.from_pretrained(checkpoints("phi3-window-longrope"))
    rope = phi3_rope(cfg, head_dim_of(cfg))  # Phi-3 configs have no head_dim field
    long_inv, scale = ROPE_INIT_FUNCTIONS["longrope"](cfg, torch.device("cpu"), seq_len=65)
    short_inv, _ = ROPE_INIT_FUNCTIONS["longrope"](cfg, torch.device("cpu"), seq_len=10)
    assert scale != 1.0 and not torch.allclose(long_inv, short_inv)
    cos, sin = rope._build(80, torch.device("cpu"))
    for pos, inv in ((63, short_inv), (64, long_inv), (79, long_inv)):
        freqs = pos * inv
        torch.testing.assert_close(cos[pos], torch.cat([freqs, freqs]).cos() * scale)
        torch.testing.assert_close(sin[pos], torch.cat([freqs, freqs]).sin() * scale)


def _runner(path: str, attention: str, **model) -> ModelRunner:
    cfg = Config.build({
        "model": {"path": path, **model},
        "stack": {"attention": attention},
        "runtime": {"device": "cpu", "dtype": "float32", "num_threads": 1},
        "scheduler": {"max_total_tokens": 2048, "max_running_requests": 8},
    })
    return ModelRunner(cfg, show_progress=False)


@pytest.mark.parametrize("attention", ["torch_native", "cpu_batched"])
def test_windowed_model_through_the_runner(checkpoints, attention):
    """A sliding-window model served with the full context (no capping to the window): greedy
    outputs of prompts longer than the window match transformers, batched and with chunked prefill."""
    path = checkpoints("gemma2-softcap-window")
    runner = _runner(path, attention)
    assert attention != "cpu_batched" or runner.attn_backend.uses_native_kernel
    assert runner.context_len == AutoConfig.from_pretrained(path).max_position_embeddings > 8 * WINDOW
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, runner.vocab_size, (n,), generator=gen).tolist() for n in (21, 19, 24)]
    batched = greedy_generate(runner, prompts, 10, keep_logits=True)
    chunked = greedy_generate(runner, prompts, 10, prefill_chunk=6)
    for prompt, got, again in zip(prompts, batched, chunked, strict=True):
        ref_tokens, ref_logits = hf_greedy(hf, prompt, 10)
        torch.testing.assert_close(got.logits[0], ref_logits[0], rtol=1e-4, atol=1e-4)
        assert got.tokens == ref_tokens and again.tokens == ref_tokens


def test_a_backend_without_windows_is_refused_by_name(checkpoints, monkeypatch):
    from radixserve_attention_torch_native.backend import TorchNativeBackend

    class NoWindows(TorchNativeBackend):
        name = "no_windows"  # a subclass makes no promises of its own: both option flags are False

    assert not NoWindows.supports_sliding_window and not NoWindows.supports_logit_cap
    load = Registry.load
    monkeypatch.setattr(Registry, "load", lambda self, kind, name: NoWindows if kind == "attention" else load(
        self, kind, name))
    with pytest.raises(ValueError, match="sliding_window=4.*'torch_native'.*supports_sliding_window"):
        _runner(checkpoints("mistral-window"), "torch_native")


def test_radix_attention_rejects_bad_options():
    from radixserve.layers.attention import RadixAttention

    with pytest.raises(ValueError, match="sliding_window.*-3"):
        RadixAttention(0, 4, 2, 16, 0.25, sliding_window=-3)
    with pytest.raises(ValueError, match="logit_cap.*-1"):
        RadixAttention(0, 4, 2, 16, 0.25, logit_cap=-1.0)
    layer = RadixAttention(0, 4, 2, 16, 0.25, sliding_window=0, logit_cap=0.0)  # 0 means off, as in HF configs
    assert layer.sliding_window is None and layer.logit_cap is None
