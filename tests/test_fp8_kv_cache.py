"""FP8 KV cache (`runtime.kv_cache_dtype: fp8_e4m3`): the quantizer, the pool, the checkpoint's scales,
torch_native (the reference) against a float pool, the start-up refusals, and greedy generation
through the Engine against the model-dtype KV cache (top-5 rule). The triton kernels on fp8 pools
are in test_attention_triton_fp8.py."""

from __future__ import annotations

import glob
import os
import shutil
from types import SimpleNamespace

import pytest
import torch
from hf_reference import first_divergence
from radixserve.config import Config, ConfigError
from radixserve.memory import KVPool, ReqToTokenPool, kv_bytes_per_token, tokens_for_budget
from radixserve.memory.fp8_kv import FP8_E4M3_MAX, KVScaleCollector, dequantize_fp8, kv_scale_target, quantize_fp8
from radixserve.plugins.registry import PluginError, Registry
from radixserve.plugins.stack import resolve_stack
from radixserve.state import ForwardBatch, ForwardMode
from radixserve_attention_torch_native.backend import TorchNativeBackend

FP8 = torch.float8_e4m3fn


# ---- the quantizer ------------------------------------------------------------------------------
def test_round_trip_within_e4m3_precision_and_exact_on_its_grid():
    x = torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 3
    for scale in (1.0, 0.01, 7.5):
        back = dequantize_fp8(quantize_fp8(x * scale, scale), scale, torch.float32)
        # 3 mantissa bits: a normal value rounds to within 2^-4 relative; tiny ones to the subnormal step 2^-9
        assert ((back - x * scale).abs() <= (x * scale).abs() * 2**-4 + 2**-10 * scale).all()
    grid = torch.tensor([0.0, 0.5, -1.75, 3.0, 448.0, -448.0, 2**-9])  # e4m3 values: stored exactly
    assert torch.equal(dequantize_fp8(quantize_fp8(grid, 1.0), 1.0, torch.float32), grid)


def test_saturation_not_nan():
    x = torch.tensor([1e4, -1e6, float("inf"), 500.0, -449.0])
    q = quantize_fp8(x, 1.0)
    assert torch.equal(q.float(), torch.tensor([448.0, -448.0, 448.0, 448.0, -448.0]))
    assert torch.equal(dequantize_fp8(quantize_fp8(x * 0.5, 0.5), 0.5, torch.float32)[:2],
                       torch.tensor([FP8_E4M3_MAX * 0.5, -FP8_E4M3_MAX * 0.5]))


# ---- the pool -----------------------------------------------------------------------------------
def test_fp8_pool_stores_quantized_and_reads_real_values():
    pool = KVPool(8, 2, 2, 16, FP8, k_scales=[1.0, 0.5], v_scales=[2.0, 0.25])
    k, v = torch.randn(3, 32), torch.randn(3, 2, 16)
    loc = torch.tensor([2, 5, 7])
    pool.set_kv(1, loc, k, v)
    assert pool.is_fp8 and pool.get_kv(1)[0].dtype == FP8 and pool.kv_scales(1) == (0.5, 0.25)
    assert torch.equal(pool.k_buffers[1][loc].view(torch.uint8), quantize_fp8(k.view(3, 2, 16), 0.5).view(torch.uint8))
    rk, rv = pool.read_kv(1, loc, torch.float32)
    assert torch.allclose(rk, k.view(3, 2, 16), rtol=2**-4, atol=2**-9)
    assert torch.allclose(rv, v, rtol=2**-4, atol=2**-11)
    assert not pool.get_kv(0)[0].any().item() and not pool.k_buffers[1][[0, 1, 3]].float().any()  # nothing else written
    kq, vq = pool.quantize_kv(1, k.view(3, 2, 16), v)
    pool.set_kv(1, loc, kq, vq)  # already quantized: stored as is, not divided twice
    assert torch.equal(pool.read_kv(1, loc, torch.float32)[0], rk)


def test_fp8_pool_is_half_the_bytes_of_bf16_twice_the_tokens():
    assert kv_bytes_per_token(32, 8, 128, FP8) * 2 == kv_bytes_per_token(32, 8, 128, torch.bfloat16)
    budget = 10 * 2**30
    assert tokens_for_budget(budget, 32, 8, 128, FP8) == 2 * tokens_for_budget(budget, 32, 8, 128, torch.bfloat16)
    assert KVPool(100, 2, 2, 16, FP8).nbytes() * 2 == KVPool(100, 2, 2, 16, torch.bfloat16).nbytes()


def test_pool_scale_errors():
    with pytest.raises(ValueError, match="k_scales must be 2 positive finite floats"):
        KVPool(4, 2, 1, 16, FP8, k_scales=[1.0])
    with pytest.raises(ValueError, match="v_scales"):
        KVPool(4, 2, 1, 16, FP8, v_scales=[1.0, 0.0])
    with pytest.raises(ValueError, match="float8_e4m3fn pools only"):
        KVPool(4, 2, 1, 16, torch.float32, k_scales=[1.0, 2.0])


def test_checkpoint_scale_names():
    assert kv_scale_target("model.layers.3.self_attn.k_scale") == (3, ("k",))
    assert kv_scale_target("model.layers.12.self_attn.v_scale") == (12, ("v",))
    assert kv_scale_target("model.layers.0.self_attn.kv_scale") == (0, ("k", "v"))
    assert kv_scale_target("model.layers.1.self_attn.v_proj.output_scale") == (1, ("v",))
    for other in ("model.layers.1.self_attn.k_proj.weight_scale", "model.layers.1.self_attn.k_proj.input_scale",
                  "model.layers.1.mlp.down_proj.weight", "lm_head.weight"):
        assert kv_scale_target(other) is None
    c = KVScaleCollector()
    rest = list(c.filter([("a.weight", torch.ones(1)), ("model.layers.1.self_attn.k_scale", torch.tensor(0.5)),
                          ("model.layers.0.self_attn.kv_scale", torch.tensor([0.25]))]))
    assert [n for n, _ in rest] == ["a.weight"] and c.scales(3) == ([0.25, 0.5, 1.0], [0.25, 1.0, 1.0])
    with pytest.raises(ValueError, match="must be one value"):
        list(c.filter([("model.layers.0.self_attn.v_scale", torch.ones(4))]))
    with pytest.raises(ValueError, match="positive and finite"):
        list(c.filter([("model.layers.0.self_attn.v_scale", torch.tensor(-1.0))]))


# ---- torch_native: fp8 vs a float pool ----------------------------------------------------------
def _torch_native_out(dtype, prefix_lens, extend_lens, scales=(1.0, 1.0), seed=0):
    gen = torch.Generator().manual_seed(seed)
    h, kvh, d = 4, 2, 32
    seq = [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)]
    kw = {"k_scales": [scales[0]], "v_scales": [scales[1]]} if dtype == FP8 else {}
    pool = KVPool(sum(seq) + 2, 1, kvh, d, dtype, **kw)
    r2t = ReqToTokenPool(len(seq), max(seq))
    out_loc, at = [], 1
    for i, (p, n) in enumerate(zip(prefix_lens, seq, strict=True)):
        slots = torch.arange(at, at + n)
        at += n
        r2t.write(i, 0, slots)
        pool.set_kv(0, slots[:p], torch.randn(p, kvh, d, generator=gen), torch.randn(p, kvh, d, generator=gen))
        out_loc.append(slots[p:])
    t = sum(extend_lens)
    q, k, v = (torch.randn(t, x * d, generator=gen) for x in (h, kvh, kvh))
    backend = TorchNativeBackend(None)
    batch = ForwardBatch(
        mode=ForwardMode.DECODE if set(extend_lens) == {1} else ForwardMode.EXTEND, batch_size=len(seq),
        input_ids=torch.zeros(t, dtype=torch.int64), positions=torch.zeros(t, dtype=torch.int64),
        req_pool_indices=torch.arange(len(seq)), seq_lens=torch.tensor(seq), prefix_lens=torch.tensor(prefix_lens),
        extend_lens=torch.tensor(extend_lens), out_cache_loc=torch.cat(out_loc), req_to_token_pool=r2t, kv_pool=pool,
        attn_backend=backend, seq_lens_cpu=seq, prefix_lens_cpu=list(prefix_lens), extend_lens_cpu=list(extend_lens),
    )
    backend.init_forward_metadata(batch)
    layer = SimpleNamespace(layer_id=0, num_heads=h, num_kv_heads=kvh, head_dim=d, scaling=d**-0.5)
    return backend.forward(q, k, v, layer, batch)


# Each stored value is within 2^-4 (6.25%) of the real one, about 2.3% rms for uniform rounding; attention
# averages values and the softmax is smooth in the scores, so outputs stay within ~5% rms. Measured: ~2.5%.
FP8_VS_FLOAT_RTOL = 0.05


@pytest.mark.parametrize("prefix_lens,extend_lens", [([30, 0, 7], [5, 12, 1]), ([50, 3, 19], [1, 1, 1])])
@pytest.mark.parametrize("scales", [(1.0, 1.0), (0.02, 0.05)])
def test_torch_native_fp8_within_tolerance_of_float_kv(prefix_lens, extend_lens, scales):
    want = _torch_native_out(torch.float32, prefix_lens, extend_lens)
    got = _torch_native_out(FP8, prefix_lens, extend_lens, scales)
    rel = ((got - want).norm() / want.norm()).item()
    assert 0 < rel < FP8_VS_FLOAT_RTOL, f"fp8 vs fp32 KV: relative error {rel:.3f}"


# ---- configuration and refusals -----------------------------------------------------------------
def _config(**runtime) -> Config:
    return Config.build({"runtime": {"device": "cpu", **runtime}})


def test_config_key_and_bad_value():
    assert _config().runtime.kv_cache_dtype == "auto"
    assert _config(kv_cache_dtype="fp8_e4m3").runtime.kv_cache_dtype == "fp8_e4m3"
    with pytest.raises(ConfigError, match="runtime.kv_cache_dtype.*fp8_e5m2"):
        _config(kv_cache_dtype="fp8_e5m2")


def test_fp8_refused_on_backends_without_support_naming_those_with_it():
    cfg = _config(kv_cache_dtype="fp8_e4m3").with_overrides({"stack": {"attention": "cpu_batched"}})
    with pytest.raises(PluginError) as e:
        resolve_stack(cfg, Registry.from_config(cfg), "cpu")
    msg = str(e.value)
    assert "runtime.kv_cache_dtype='fp8_e4m3'" in msg and "'cpu_batched'" in msg
    assert "supports_fp8_kv_cache is False" in msg and "support it on cpu: torch_native" in msg


def test_fp8_default_backend_is_one_that_supports_it():
    reg = Registry.from_config(_config())
    assert resolve_stack(_config(), reg, "cpu").attention.name == "cpu_batched"  # the CPU default ...
    assert resolve_stack(_config(kv_cache_dtype="fp8_e4m3"), reg, "cpu").attention.name == "torch_native"  # ... lacks it


def test_fp8_refused_for_latent_attention_models():
    cfg = _config(kv_cache_dtype="fp8_e4m3")
    with pytest.raises(PluginError, match="uses latent attention \\(MLA\\).*set runtime.kv_cache_dtype=auto"):
        resolve_stack(cfg, Registry.from_config(cfg), "cpu", attention_type="latent", model_name="DeepseekV3")


# ---- end to end on a tiny checkpoint ------------------------------------------------------------
K_SCALE, V_SCALE = 0.02, 0.01


@pytest.fixture(scope="module")
def scaled_checkpoint(tiny_llama_dir, tmp_path_factory) -> str:
    """The tiny llama checkpoint plus per-layer `self_attn.k_scale` / `v_scale` tensors, as an fp8 (vLLM/HF)
    checkpoint ships them."""
    from safetensors.torch import load_file, save_file

    src = tiny_llama_dir("llama")
    dst = str(tmp_path_factory.mktemp("fp8kv-ckpt"))
    shutil.copytree(src, dst, dirs_exist_ok=True)
    (file,) = glob.glob(os.path.join(dst, "*.safetensors"))
    tensors = load_file(file)
    layers = {int(n.split(".")[2]) for n in tensors if n.startswith("model.layers.")}
    for i in layers:
        tensors[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(K_SCALE * (1 + i))
        tensors[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(V_SCALE)
    save_file(tensors, file, metadata={"format": "pt"})
    from radixserve.testing.grammar import tiny_tokenizer

    tiny_tokenizer().save_pretrained(dst)  # the Engine needs a tokenizer; its ~300 ids fit the model's 512
    return dst


def _runner_config(path: str, kv: str) -> Config:
    return Config.build({
        "model": {"path": path}, "runtime": {"device": "cpu", "num_threads": 1, "kv_cache_dtype": kv},
        "scheduler": {"cpu_kv_cache_gb": 0.01, "max_running_requests": 4},
    })


@pytest.fixture(scope="module")
def runners(scaled_checkpoint):
    from radixserve.model_runner import ModelRunner

    return {kv: ModelRunner(_runner_config(scaled_checkpoint, kv), show_progress=False) for kv in ("fp8_e4m3", "auto")}


def test_runner_builds_fp8_pool_with_checkpoint_scales_and_twice_the_tokens(runners):
    fp8, auto = runners["fp8_e4m3"], runners["auto"]  # auto: the checkpoint's scales are read and ignored
    n = fp8.kv_pool.num_layers
    assert fp8.kv_pool.dtype == FP8 and auto.kv_pool.dtype == torch.float32
    assert fp8.kv_pool.k_scales == pytest.approx([K_SCALE * (1 + i) for i in range(n)])
    assert fp8.kv_pool.v_scales == pytest.approx([V_SCALE] * n)
    assert fp8.attn_backend_name == "torch_native"
    # fp32 on the CPU: a quarter of the bytes (bf16 on a GPU: half), so four times the tokens in the budget
    assert fp8.kv_bytes_per_token() * 4 == auto.kv_bytes_per_token()
    assert fp8.max_total_tokens // 4 == auto.max_total_tokens  # floor(budget / bytes) both ways


def test_engine_greedy_fp8_kv_follows_model_dtype_kv_top5(scaled_checkpoint, runners):
    """Greedy generations through the Engine with the fp8 KV cache (scales from the checkpoint, the
    default fp8-capable CPU backend, chunked prefill) against the model-dtype (fp32) cache: equal, or
    at the first divergence each side's token is in the other's top 5."""
    from radixserve.engine import Engine
    from runner_driver import greedy_generate

    prompts = [[3, 17, 42, 9, 100, 7, 55], [8, 8, 1, 250, 31], list(range(5, 40))]
    params = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
    config = _runner_config(scaled_checkpoint, "fp8_e4m3").with_overrides(
        {"runtime": {"cuda_graph": False}, "scheduler": {"chunked_prefill_size": 16}})
    with Engine(config=config) as eng:
        outs = eng.generate(input_ids=prompts, sampling_params=params, return_logprob=True, top_logprobs_num=5)
    refs = greedy_generate(runners["auto"], prompts, 12, keep_logits=True)
    for got, want in zip(outs, refs, strict=True):
        a, b = got["output_ids"], want.tokens
        tops = got["meta_info"]["output_top_logprobs"]  # per step: (logprob, token id) pairs
        # the first token's distribution: fp8 rounding moves log-probabilities by ~0.1 on this model
        # (measured); a scale applied wrongly (or not at all) moves them by far more
        ref_logprobs = want.logits[0].log_softmax(-1)
        for logprob, tok in tops[0]:
            assert abs(logprob - ref_logprobs[tok].item()) < FIRST_STEP_LOGPROB_ATOL, (tok, logprob)
        i = first_divergence(a, b)
        if i is not None:  # near-ties of a random model may part them: the top-5 rule
            top_a = [t for _, t in tops[i]]
            top_b = want.logits[i].topk(5).indices.tolist()
            assert a[i] in top_b and b[i] in top_a, f"fp8 KV {a} vs fp32 KV {b}: top-5 rule broken at step {i}"


FIRST_STEP_LOGPROB_ATOL = 0.3
