"""The runner around the Llama family: batch and chunking invariance, load errors, dummy weights,
GGUF, overlap scheduling, warm-up. Parity of every architecture with transformers is the model
kit's, run by tests/test_conformance.py."""

from __future__ import annotations

import pytest
import torch
from hf_reference import hf_greedy
from radixserve.config import Config
from radixserve.model_runner import ModelRunner
from runner_driver import greedy_generate
from transformers import AutoModelForCausalLM

NEW_TOKENS = 32
PROMPT_LENS = (5, 13, 2, 21)

def make_runner(path: str, weight_source_options: dict | None = None, **scheduler) -> ModelRunner:
    cfg = Config.build({
        "model": {"path": path, "weight_source_options": weight_source_options or {}},
        "runtime": {"device": "cpu", "dtype": "float32", "num_threads": 1},  # no OpenMP oversubscription
        "scheduler": {"max_total_tokens": 2048, "max_running_requests": 8, **scheduler},
    })
    return ModelRunner(cfg, show_progress=False)


def prompts_for(vocab: int, seed: int = 1) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENS]


def test_batch_and_chunking_invariance(tiny_llama_dir):
    """A request's greedy output is the same alone, inside a mixed batch, and with chunked prefill."""
    path = tiny_llama_dir("qwen3", tie_word_embeddings=False)
    runner = make_runner(path)
    prompts = prompts_for(runner.vocab_size, seed=7)
    batched = [g.tokens for g in greedy_generate(runner, prompts, 16)]
    for prompt, want in zip(prompts, batched, strict=True):
        assert greedy_generate(runner, [prompt], 16)[0].tokens == want
        assert greedy_generate(runner, [prompt], 16, prefill_chunk=3)[0].tokens == want


def test_unloaded_parameters_are_an_error(tiny_llama_dir, tmp_path):
    """A checkpoint missing a tensor is reported by name, not silently left uninitialised."""
    import shutil

    from safetensors.torch import load_file, save_file

    src = tiny_llama_dir("llama", tie_word_embeddings=False)
    shutil.copy(f"{src}/config.json", tmp_path / "config.json")
    weights = load_file(f"{src}/model.safetensors")
    del weights["model.layers.1.mlp.down_proj.weight"]
    save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="model.layers.1.mlp.down_proj.weight"):
        make_runner(str(tmp_path))


def test_dummy_weights_build_at_real_shape(tiny_llama_dir):
    path = tiny_llama_dir("llama", tie_word_embeddings=False)
    cfg = Config.build({
        "model": {"path": path, "load_format": "dummy"},
        "runtime": {"device": "cpu", "dtype": "bfloat16"},
        "scheduler": {"max_total_tokens": 256, "max_running_requests": 2},
    })
    runner = ModelRunner(cfg, show_progress=False)
    assert runner.dtype == torch.bfloat16 and runner.kv_pool.k_buffers[0].dtype == torch.bfloat16
    out = greedy_generate(runner, [[1, 2, 3]], 4)
    assert len(out[0].tokens) == 4 and all(0 <= t < runner.vocab_size for t in out[0].tokens)


def _write_tiny_gguf(hf_dir: str, out: str, qtypes: tuple[str, ...] = ("Q8_0", "Q4_1", "Q4_0"),
                     embedding: str = "F16", arch: str = "llama", drop: tuple[str, ...] = ()) -> None:
    """Convert a tiny HF Llama checkpoint to GGUF the way llama.cpp does (q/k rows permuted,
    the 2-D tensors but the embedding (F16) in `qtypes` in turn: mixed by default; a llama3 rope
    as llama.cpp writes it, one factor per frequency in `rope_freqs.weight`), so the GGUF path can
    be checked without a big file. `arch`: general.architecture (the keys are written under it); `drop`: GGUF
    tensor names left out of the file."""
    import gguf
    import numpy as np
    from safetensors.torch import load_file
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(hf_dir)
    w = gguf.GGUFWriter(out, arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    rope = cfg.rope_parameters
    if rope.get("rope_type") == "llama3":
        from radixserve_quant_gguf.hf_config import llama3_rope_factors

        inv_freq = rope["rope_theta"] ** (-np.arange(0, cfg.head_dim, 2, dtype=np.float64) / cfg.head_dim)
        factors = llama3_rope_factors(inv_freq, rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"],
                                      rope["original_max_position_embeddings"])
        w.add_tensor("rope_freqs.weight", factors.astype(np.float32))

    def permute(x: np.ndarray, heads: int) -> np.ndarray:
        return x.reshape(heads, 2, x.shape[0] // heads // 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)

    names = {v: k for k, v in (("token_embd.weight", "model.embed_tokens.weight"),
                               ("output_norm.weight", "model.norm.weight"), ("output.weight", "lm_head.weight"))}
    layer = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
             "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
             "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
             "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
             "mlp.down_proj.weight": "ffn_down.weight"}
    qtypes = [gguf.GGMLQuantizationType[q] for q in qtypes]
    for i, (name, t) in enumerate(sorted(load_file(f"{hf_dir}/model.safetensors").items())):
        x = t.float().numpy()
        if name in names:
            gname = names[name]
        else:
            n, rest = name.removeprefix("model.layers.").split(".", 1)
            gname = f"blk.{n}.{layer[rest]}"
        if gname in drop:
            continue
        if rest_is(name, "q_proj"):
            x = permute(x, cfg.num_attention_heads)
        elif rest_is(name, "k_proj"):
            x = permute(x, cfg.num_key_value_heads)
        if x.ndim == 1:
            w.add_tensor(gname, x)
        elif name == "model.embed_tokens.weight" and embedding == "F32":
            w.add_tensor(gname, x)
        elif name == "model.embed_tokens.weight":
            w.add_tensor(gname, x.astype(np.float16))
        else:
            q = qtypes[i % len(qtypes)]
            w.add_tensor(gname, gguf.quants.quantize(x, q), raw_dtype=q)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def rest_is(name: str, proj: str) -> bool:
    return name.endswith(f"self_attn.{proj}.weight")


def test_gguf_matches_transformers(tiny_llama_dir, tmp_path):
    """A llama.cpp-layout GGUF (F16/F32/Q8_0/Q4_0/Q4_1) loads to the same model transformers builds from it."""
    path = str(tmp_path / "tiny.gguf")
    _write_tiny_gguf(tiny_llama_dir("llama", tie_word_embeddings=False), path)
    runner = make_runner(path, {"dequantize": True})  # the fp32 path transformers computes
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="tiny.gguf", dtype=torch.float32).eval()
    for key in ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "hidden_size", "vocab_size",
                "tie_word_embeddings"):
        assert getattr(runner.hf_config, key) == getattr(hf.config, key), key
    prompts = prompts_for(runner.vocab_size, seed=3)[:2]
    ours = greedy_generate(runner, prompts, 16, keep_logits=True)
    for prompt, got in zip(prompts, ours, strict=True):
        ref_tokens, ref_logits = hf_greedy(hf, prompt, 16)
        torch.testing.assert_close(got.logits[0], ref_logits[0], rtol=1e-4, atol=1e-4)
        assert got.tokens == ref_tokens


def test_a_llama3_rope_gguf_matches_the_checkpoint_it_was_converted_from(tiny_llama_dir, tmp_path):
    """GGUF audit 33: every Llama 3.1-3.3 conversion holds rope_freqs.weight (llama3 rope scaling as one
    factor per frequency), and such files were refused. The parameters that give those factors are found
    and the file computes what the HF checkpoint does (transformers' own GGUF import ignores the tensor)."""
    rope = dict(rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                original_max_position_embeddings=64)
    hf_dir = tiny_llama_dir("llama", tie_word_embeddings=False, rope_parameters=rope)
    path = str(tmp_path / "llama3.gguf")
    _write_tiny_gguf(hf_dir, path, qtypes=("F32",), embedding="F32")
    runner = make_runner(path, {"dequantize": True})
    assert runner.hf_config.rope_parameters == rope
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    prompt = prompts_for(runner.vocab_size, seed=5)[3]  # 21 tokens: past the 64 / 4 high-frequency wavelength
    got = greedy_generate(runner, [prompt], 48, keep_logits=True)[0]  # to position 68, past the original context
    ref_tokens, ref_logits = hf_greedy(hf, prompt, 48)
    torch.testing.assert_close(got.logits[-1], ref_logits[-1], rtol=1e-4, atol=1e-4)
    assert got.tokens == ref_tokens


def test_a_tensor_missing_from_a_gguf_is_named_as_the_file_names_it(tiny_llama_dir, tmp_path):
    """GGUF audit 33: the unloaded parameter was named only as the HF model's (model.layers.1.mlp.down_proj.weight),
    a name the file does not use."""
    hf_dir = tiny_llama_dir("llama", tie_word_embeddings=False)
    path = str(tmp_path / "missing.gguf")
    _write_tiny_gguf(hf_dir, path, drop=("blk.1.ffn_down.weight",))
    cfg = Config.build({"model": {"path": path, "tokenizer": hf_dir}, "runtime": {"device": "cpu", "dtype": "float32"},
                        "scheduler": {"max_total_tokens": 256}})
    with pytest.raises(ValueError, match=r"left 1 parameter\(s\) unloaded: model\.layers\.1\.mlp\.down_proj\.\w+ "
                                         r"\(blk\.1\.ffn_down\.weight in the file\)"):
        ModelRunner(cfg, show_progress=False)


def test_a_gguf_the_reader_cannot_serve_is_one_line_naming_the_file(tiny_llama_dir, tmp_path):
    """GGUF audit 33: an unsupported architecture or tensor type was a NotImplementedError (a traceback, exit 1);
    now a ValueError naming the file, which the CLI reports as one line with exit 2."""
    from radixserve_quant_gguf.hf_config import UnsupportedGGUF, build_hf_config
    from radixserve_quant_gguf.reader import open_gguf

    hf_dir = tiny_llama_dir("llama", tie_word_embeddings=False)
    gemma = str(tmp_path / "gemma2.gguf")
    _write_tiny_gguf(hf_dir, gemma, arch="gemma2")
    with pytest.raises(UnsupportedGGUF, match=r"gemma2\.gguf: GGUF architecture 'gemma2' is not supported \(the GGUF "
                                              r"reader serves llama, qwen2, qwen3"):
        build_hf_config(open_gguf(gemma))
    q2k = str(tmp_path / "q2k.gguf")
    _write_tiny_gguf(hf_dir, q2k, qtypes=("F32",))
    import gguf

    reader = open_gguf(q2k)
    reader.tensors[-1].tensor_type = gguf.GGMLQuantizationType.Q2_K  # what an unsupported quantization reads as
    with pytest.raises(UnsupportedGGUF, match=r"q2k\.gguf: tensor '.*' has type Q2_K, which the GGUF reader cannot "
                                              r"read"):
        build_hf_config(reader)
    assert issubclass(UnsupportedGGUF, ValueError)


def test_gguf_passes_the_weight_source_kit(tiny_llama_dir, tmp_path):
    """The in-tree GGUF reader runs the same kit a third-party weight source does
    (`radixserve.testing.check_weight_source`), against transformers' own GGUF import saved as a
    safetensors directory."""
    from radixserve.testing import check_weight_source
    from radixserve_quant_gguf.method import GGUFMethod

    path = str(tmp_path / "tiny.gguf")
    _write_tiny_gguf(tiny_llama_dir("llama", tie_word_embeddings=False), path)
    import json

    from safetensors.torch import save_file

    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="tiny.gguf", dtype=torch.float32)
    reference = tmp_path / "reference"  # transformers will not save_pretrained a GGUF import: its parts by hand
    reference.mkdir()
    config = {k: v for k, v in hf.config.to_dict().items() if k != "quantization_config"}
    (reference / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, str(reference / "model.safetensors"))
    check_weight_source(GGUFMethod, path, reference=str(reference), options={"dequantize": True})


@pytest.mark.parametrize("attention", ["torch_native", "cpu_batched"])
def test_overlap_scheduling_keeps_greedy_outputs(tiny_llama_dir, attention):
    """The real runner behind the scheduler: launching each decode ahead of its input tokens
    (FutureTokens read from the previous step's device output) gives the same greedy tokens."""
    from radixserve.plugins.registry import Registry
    from radixserve.runtime.messages import GenerateRequest
    from radixserve.scheduler import Scheduler
    from radixserve.state import SamplingParams

    path = tiny_llama_dir("llama", tie_word_embeddings=False)
    outputs = {}
    for overlap in (False, True):
        cfg = Config.build({
            "model": {"path": path},
            "stack": {"attention": attention},
            "runtime": {"device": "cpu", "dtype": "float32", "num_threads": 1, "overlap": overlap},
            "scheduler": {"max_total_tokens": 2048, "max_running_requests": 8},
        })
        runner = ModelRunner(cfg, show_progress=False)
        events: list[str] = []  # the order in which batches are launched and their results taken
        launch = runner.launch_batch

        def recording_launch(sb, launch=launch, events=events):
            launched = launch(sb)
            n = sum(e.startswith("launch") for e in events)
            events.append(f"launch {n}")
            resolve = launched.result

            def result():
                events.append(f"result {n}")
                return resolve()

            launched.result = result
            return launched

        runner.launch_batch = recording_launch
        sched = Scheduler.from_config(cfg, runner, Registry.discover())
        for i, prompt in enumerate(prompts_for(sched.runner.vocab_size, seed=3)):
            sp = SamplingParams(max_new_tokens=12 + 3 * i, temperature=0, ignore_eos=True)
            sched.add_request(GenerateRequest(rid=str(i), input_ids=prompt, sampling_params=sp))
        got: dict[str, list[int]] = {}
        while sched.has_work():
            for out in sched.step():
                got.setdefault(out.rid, []).extend(out.new_ids)
        assert sched.flush_cache() and sched.allocator.available_size() == sched.allocator.size
        assert (sched.metrics.overlapped_batches > 10) == overlap
        # overlap: step N+1 is launched before step N's result is taken, for every launched-ahead batch
        ahead = sum(1 for a, b in zip(events, events[1:]) if a.startswith("launch") and b.startswith("result")
                    and int(a.split()[1]) == int(b.split()[1]) + 1)
        assert ahead == (sched.metrics.overlapped_batches if overlap else 0)
        outputs[overlap] = got
    assert outputs[True] == outputs[False]
    assert [len(outputs[True][str(i)]) for i in range(4)] == [12, 15, 18, 21]


def test_warmup_leaves_the_pools_free_and_outputs_unchanged(tiny_llama_dir):
    path = tiny_llama_dir("llama", tie_word_embeddings=False)
    runner = make_runner(path)
    prompts = prompts_for(runner.vocab_size, seed=5)
    before = [g.tokens for g in greedy_generate(runner, prompts, 8)]
    extends = []  # (prefix lens) of every extend batch the warm-up runs
    real_prepare = runner.prepare
    runner.prepare = lambda sb: extends.append(list(sb.prefix_lens)) or real_prepare(sb)
    runner.warmup()
    del runner.prepare
    # a fresh prefill and a chunked one whose second chunk extends a cached prefix: the kernels both paths compile
    assert [0] in extends and [32, 32] in extends
    assert runner.token_allocator.available_size() == runner.token_allocator.size
    assert runner.req_to_token_pool.available_size() == runner.req_to_token_pool.size
    assert [g.tokens for g in greedy_generate(runner, prompts, 8)] == before


def test_warmup_fits_a_small_context_and_pool(tiny_llama_dir):
    # the chunked warm-up prompts (48 and 45 tokens) do not fit a 24-token context: a server started
    # with a small model.context_length must still become ready (the fresh prefill alone warms up)
    path = tiny_llama_dir("llama", tie_word_embeddings=False)
    cfg = Config.build({"model": {"path": path, "context_length": 24},
                        "runtime": {"device": "cpu", "dtype": "float32", "num_threads": 1},
                        "scheduler": {"max_total_tokens": 64, "max_running_requests": 4}})
    runner = ModelRunner(cfg, show_progress=False)
    runner.warmup()
    assert runner.token_allocator.available_size() == runner.token_allocator.size


def test_a_context_longer_than_the_kv_pool_is_capped_or_refused(tiny_llama_dir, caplog):
    """Long-context audit 34: a pool smaller than the context still advertised the context, so chat's default
    max_tokens (the rest of it) never fit and every such request was refused naming max_new_tokens. The model's
    own context is now capped at the pool, with a warning; one asked for in model.context_length is refused."""
    path = tiny_llama_dir("llama")  # max_position_embeddings 512
    cfg = Config.build({"model": {"path": path}, "runtime": {"device": "cpu", "dtype": "float32"},
                        "scheduler": {"max_total_tokens": 200}})
    with caplog.at_level("WARNING", logger="radixserve.model_runner"):
        runner = ModelRunner(cfg, show_progress=False)
    assert runner.context_len == 200 and runner.max_total_tokens == 200
    assert any("fewer than the model's context of 512: the context is capped at 200" in r.getMessage()
               for r in caplog.records)
    asked = cfg.with_overrides({"model": {"context_length": 400}})
    with pytest.raises(ValueError, match=r"model.context_length=400 exceeds the KV pool's 200 token slots"):
        ModelRunner(asked, show_progress=False)
