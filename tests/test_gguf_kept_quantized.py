"""GGUF blocks kept quantized on the CPU (radixserve-quant-gguf's kernels.py / csrc/gguf_blocks.cpp):
the block formats against the `gguf` package's dequantize, the int8 and int16-activation kernels
against fp32 math,
the option that picks the path (dequantized by default; `auto` keeps the blocks on the CPU, dequantized
with the reason logged where they cannot stay), and SmolLM2 served kept-quantized vs dequantized at load."""

from __future__ import annotations

import logging
import re

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf_fixtures import build
from hf_reference import first_divergence, top5_rule_holds
from radixserve.config import Config
from radixserve.layers.flat_decoder import FlatDecoderLayer
from radixserve.model_runner import ModelRunner
from radixserve.plugins.registry import Registry
from radixserve.runtime.messages import GenerateRequest
from radixserve.scheduler import Scheduler
from radixserve.scheduler.speculative.setup import drafter_info
from radixserve.state import SamplingParams
from radixserve.tokenizer import apply_chat_template
from radixserve_quant_gguf import kernels
from radixserve_quant_gguf.method import GGUFMethod
from runner_driver import greedy_generate
from test_model_parity import _write_tiny_gguf
from test_speculative_model import TableDrafter

TYPES = ("Q4_0", "Q4_1", "Q8_0")


@pytest.fixture(scope="module", autouse=True)
def built():
    if kernels.load() is None:
        pytest.fail("the GGUF block kernels did not build (see the log)")


@pytest.mark.parametrize("qtype", TYPES)
def test_dequantize_bit_exact_with_gguf_package(qtype):
    blocks, expected = build(qtype, 40, 256, seed=1)
    ref = gguf_dequantize(blocks, GGMLQuantizationType[qtype]).reshape(40, 256)
    assert np.array_equal(ref, expected)  # the fixture is the published layout
    ours = kernels.dequantize(torch.from_numpy(blocks), qtype, 256).numpy()
    assert np.array_equal(ours, ref)
    ids = torch.tensor([[3, 0], [39, 3]])
    rows = kernels.embedding(ids, torch.from_numpy(blocks), qtype, 256)
    assert rows.shape == (2, 2, 256) and torch.equal(rows, torch.from_numpy(ref)[ids])


def _rounded_activations(x: torch.Tensor, bits: int) -> torch.Tensor:
    """x rounded as the kernel quantizes it: to `bits`-bit integers per 32-block, scale amax / (2^(bits-1) - 1)."""
    b = x.reshape(x.shape[0], -1, 32)
    d = b.abs().amax(-1, keepdim=True) / (2 ** (bits - 1) - 1)
    return (torch.round(b / torch.where(d > 0, d, 1)) * d).reshape(x.shape)


# the kernel's distance from the product with x rounded as above (exact arithmetic after it), and
# from the plain fp32 product, as fractions of the output's largest value; int16's first bound is
# looser than int8's because a reference rounding x / d may land one code off the kernel's x * (1 / d)
WITHIN = {8: (1e-4, 0.02), 16: (5e-5, 2e-4)}


@pytest.mark.parametrize("act_bits", [8, 16])
@pytest.mark.parametrize("qtype", TYPES)
def test_linear_matches_fp32_within_activation_rounding(qtype, act_bits):
    # N = 100: groups of 8 rows plus a tail; M = 7: a tile of rows (AVX2: 4) plus single rows
    blocks, w = build(qtype, 100, 288, seed=2)
    blocks = torch.from_numpy(blocks)
    x = torch.randn(7, 288, generator=torch.Generator().manual_seed(0))
    y = kernels.linear(x, blocks, qtype, act_bits)
    w = torch.from_numpy(w).double()
    exact = _rounded_activations(x, act_bits).double() @ w.T
    near, far = WITHIN[act_bits]
    assert (y.double() - exact).abs().max() < near * exact.abs().max()
    plain = x.double() @ w.T  # and the rounding of x costs little
    assert (y.double() - plain).abs().max() < far * plain.abs().max()
    for i in range(7):  # each row alone gives the same bits as inside the batch
        assert torch.equal(kernels.linear(x[i : i + 1], blocks, qtype, act_bits)[0], y[i])
    # leading dimensions and non-contiguous rows: the same bits
    assert torch.equal(kernels.linear(x.view(7, 1, 288), blocks, qtype, act_bits), y.view(7, 1, 100))
    wide = torch.cat([x, torch.zeros(7, 32)], 1)[:, :288]
    assert torch.equal(kernels.linear(wide, blocks, qtype, act_bits), y)
    y16 = kernels.linear(x.to(torch.bfloat16), blocks, qtype, act_bits)
    assert y16.dtype == torch.bfloat16 and y16.shape == (7, 100)


def test_int16_activations_much_closer_to_fp32_than_int8():
    blocks, w = build("Q4_1", 64, 288, seed=4)
    x = torch.randn(16, 288, generator=torch.Generator().manual_seed(2))
    plain = x.double() @ torch.from_numpy(w).double().T
    err = {bits: (kernels.linear(x, torch.from_numpy(blocks), "Q4_1", bits).double() - plain).abs().max()
           for bits in (8, 16)}
    assert err[16] * 50 < err[8]
    with pytest.raises(RuntimeError, match="act_bits must be 8 or 16, got 4"):
        kernels.linear(x, torch.from_numpy(blocks), "Q4_1", 4)


def test_vnni_and_avx2_builds_give_the_same_bits():
    """The integer dots are exact, so the AVX2 build (vpmaddubsw / vpmaddwd) and the AVX-512 VNNI
    one (vpdpbusd / vpdpwssd) agree bit for bit on every path; checked where the CPU has VNNI (an
    AVX2-only machine runs the AVX2 build in every other test)."""
    from radixserve import native

    if kernels.isa() != "avx512_vnni":
        pytest.skip(f"this CPU's build is {kernels.isa()}: no VNNI build to compare with")
    avx2 = native.load_extension("radixserve_gguf_blocks_avx2", kernels._SOURCE, defines=("RS_NO_VNNI",))
    assert avx2 is not None and avx2.isa() == "avx2"
    vnni = kernels.load()
    for qtype in TYPES:
        blocks = torch.from_numpy(build(qtype, 100, 288, seed=5)[0])
        type_id = kernels.KEPT_TYPES[qtype][0]
        for m in (1, 7, 40):  # one row (direct), panels with a remainder
            x = torch.randn(m, 288, generator=torch.Generator().manual_seed(m))
            for act_bits in (8, 16):
                assert torch.equal(vnni.linear(x, blocks, type_id, act_bits), avx2.linear(x, blocks, type_id, act_bits))


@pytest.mark.parametrize("act_bits", [8, 16])
@pytest.mark.parametrize("qtype", TYPES)
def test_batched_panels_same_bits_as_one_row(qtype, act_bits):
    """Several rows share weight groups decoded into panels (16 and 8 output rows, a tail of 4),
    in row chunks that stay in L2 (over 900 rows at K = 288): every row of a large batch is the
    bits of that row alone, and within the activation rounding of x of the exact product."""
    blocks, w = build(qtype, 28, 288, seed=3)
    blocks = torch.from_numpy(blocks)
    x = torch.randn(1030, 288, generator=torch.Generator().manual_seed(1))
    y = kernels.linear(x, blocks, qtype, act_bits)
    exact = _rounded_activations(x, act_bits).double() @ torch.from_numpy(w).double().T
    assert (y.double() - exact).abs().max() < WITHIN[act_bits][0] * exact.abs().max()
    for i in (0, 5, 911, 1029):
        assert torch.equal(kernels.linear(x[i : i + 1], blocks, qtype, act_bits)[0], y[i])
    assert torch.equal(kernels.linear(x[3:9], blocks, qtype, act_bits), y[3:9])


def test_bad_shapes_are_clear_errors():
    blocks, _ = build("Q4_1", 8, 64)
    with pytest.raises(RuntimeError, match="hold 40 bytes, type 3 with K = 32 needs 20"):
        kernels.linear(torch.randn(2, 32), torch.from_numpy(blocks), "Q4_1")
    with pytest.raises(ValueError, match="not kept quantized"):
        kernels.row_bytes("Q6_K", 256)
    with pytest.raises(RuntimeError, match="outside"):
        kernels.embedding(torch.tensor([8]), torch.from_numpy(blocks), "Q4_1", 64)


def test_option_validation(smollm2_gguf_path, tmp_path):
    with pytest.raises(ValueError, match="dequantize must be true, false or auto, got 'yes'"):
        GGUFMethod(dequantize="yes")
    with pytest.raises(ValueError, match="activations must be one of int8, int16, got 'int4'"):
        GGUFMethod(dequantize="auto", activations="int4")
    with pytest.raises(ValueError, match="dequantize must be true, false or auto, got 1"):
        GGUFMethod(dequantize=1)
    from radixserve.model_loader.sources import open_source
    from radixserve.plugins import Registry

    reg = Registry.discover()
    with pytest.raises(ValueError, match=r"'dequantise' not accepted by the weight source 'gguf' \(valid: dequantize, activations\)"):
        open_source(smollm2_gguf_path, "auto", reg, {"dequantise": True})
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="weight_source_options"):
        open_source(str(tmp_path), "auto", reg, {"dequantize": True})


def _same_as_transformers(ours) -> None:
    from radixserve_quant_gguf.hf_config import ABSENT

    theirs = ours.to_transformers()
    for name, value in vars(ours).items():
        if not name.startswith("_"):
            assert getattr(theirs, name) == value, name
    for name in ABSENT - vars(ours).keys():
        assert not hasattr(theirs, name) and not hasattr(ours, name), name
    assert ours.to_dict() == theirs.to_dict()


def test_gguf_config_is_transformers_config_without_transformers(smollm2_gguf_path):
    """The plain config of a GGUF file holds transformers' values (llama from the file; qwen2 /
    qwen3 from the same metadata fields), and serving the file imports no transformers."""
    import subprocess
    import sys
    import textwrap

    from radixserve_quant_gguf.hf_config import GGUFModelConfig, build_hf_config
    from radixserve_quant_gguf.reader import open_gguf

    llama = build_hf_config(open_gguf(smollm2_gguf_path))
    _same_as_transformers(llama)
    assert llama.rope_scaling == llama.rope_parameters and llama.vocab_size == 49152
    for model_type, arch in (("qwen2", "Qwen2ForCausalLM"), ("qwen3", "Qwen3ForCausalLM")):
        _same_as_transformers(GGUFModelConfig(model_type, {
            **{k: v for k, v in llama._kwargs.items() if k != "architectures"}, "architectures": [arch]}))
    code = textwrap.dedent(f"""
        import sys
        from radixserve.config import Config
        from radixserve.model_runner import ModelRunner
        from radixserve.static_batch import run_static_batch
        cfg = Config.build({{"model": {{"path": {smollm2_gguf_path!r}}},
                            "runtime": {{"device": "cpu"}}, "scheduler": {{"max_total_tokens": 256}}}})
        runner = ModelRunner(cfg, show_progress=False)
        run_static_batch(runner, [[1, 2, 3], [4, 5]], max_new_tokens=2)
        print(sorted(m for m in sys.modules if m.split(".")[0] == "transformers")[:3])
        """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


NEW_TOKENS = 24
QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "List three primary colors.",
             "What is 12 times 7?"]


def _runner(path: str, dequantize: bool | str | None) -> ModelRunner:
    options = {} if dequantize is None else {"dequantize": dequantize}
    return ModelRunner(Config.build({
        "model": {"path": path, "weight_source_options": options},
        "runtime": {"device": "cpu", "dtype": "float32", "num_threads": 1},
        "scheduler": {"max_total_tokens": 2048, "max_running_requests": 4},
    }), show_progress=False)


def _param_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


@pytest.fixture(scope="module")
def smollm2_pair(smollm2_gguf_path):
    return _runner(smollm2_gguf_path, "auto"), _runner(smollm2_gguf_path, None)  # auto, and the default


def test_smollm2_dequantized_by_default_kept_with_auto(smollm2_pair):
    kept, deq = smollm2_pair  # dequantize: auto, and the default (no option: dequantize true)
    m = kept.model
    assert type(m.model.embed_tokens).__name__ == "BlockEmbedding" and m.model.embed_tokens.weight.dtype == torch.uint8
    assert m.lm_head.weight is m.model.embed_tokens.weight  # tied: the head reads the Q8_0 table
    assert m.model.layers[0].mlp.gate_up_proj.weight.dtype == torch.uint8
    assert deq.model.model.layers[0].mlp.gate_up_proj.weight.dtype == torch.float32
    # every Llama layer runs as one flat function over the method's linears, kept or dequantized
    assert all(isinstance(layer.forward, FlatDecoderLayer) for layer in m.model.layers)
    assert all(isinstance(layer.forward, FlatDecoderLayer) for layer in deq.model.model.layers)
    # the file's ~98 MB of blocks, against ~540 MB of fp32 (plus its packed copies on the fp32 path)
    assert _param_bytes(m) < 100e6 and _param_bytes(deq.model) > 5 * _param_bytes(m)


def test_smollm2_kept_vs_dequantized_top5_and_batch_invariance(smollm2_pair):
    """Kept blocks with the default int16 activations: the fp32 path's greedy answers on these
    chat questions (int8 activations part from them on the first: "L'Étoile, ..." instead of "The
    capital of France is Paris."), and the top-5 rule wherever they may part."""
    kept, deq = smollm2_pair
    prompts = [apply_chat_template(kept.tokenizer, [{"role": "user", "content": q}]) for q in QUESTIONS]
    ours = greedy_generate(kept, prompts, NEW_TOKENS, keep_logits=True)
    ref = greedy_generate(deq, prompts, NEW_TOKENS, keep_logits=True)
    for got, want in zip(ours, ref, strict=True):
        i = first_divergence(got.tokens, want.tokens)
        assert top5_rule_holds(got.tokens, got.logits, want.tokens, want.logits), f"top-5 rule broken at step {i}"
    assert ours[0].tokens == ref[0].tokens, kept.tokenizer.decode(ours[0].tokens)  # the README's question
    assert sum(got.tokens == want.tokens for got, want in zip(ours, ref, strict=True)) >= len(QUESTIONS) - 1
    alone = greedy_generate(kept, [prompts[1]], NEW_TOKENS)[0].tokens
    assert alone == ours[1].tokens


def test_smollm2_kept_int8_activations_follow_top5(smollm2_gguf_path, smollm2_pair):
    """`activations: int8` (llama.cpp's arithmetic) keeps the top-5 rule against fp32, and a row's
    result does not depend on the batch around it."""
    kept8 = ModelRunner(Config.build({
        "model": {"path": smollm2_gguf_path, "weight_source_options": {"dequantize": "auto", "activations": "int8"}},
        "runtime": {"device": "cpu", "dtype": "float32", "num_threads": 1},
        "scheduler": {"max_total_tokens": 1024, "max_running_requests": 4},
    }), show_progress=False)
    assert kept8.model.model.layers[0].mlp.gate_up_proj.gguf_act_bits == 8
    _, deq = smollm2_pair
    prompts = [apply_chat_template(kept8.tokenizer, [{"role": "user", "content": q}]) for q in QUESTIONS[1:3]]
    ours = greedy_generate(kept8, prompts, 12, keep_logits=True)
    ref = greedy_generate(deq, prompts, 12, keep_logits=True)
    for got, want in zip(ours, ref, strict=True):
        assert top5_rule_holds(got.tokens, got.logits, want.tokens, want.logits)
    assert greedy_generate(kept8, [prompts[1]], 12)[0].tokens == ours[1].tokens


def test_dequantize_false_refused_where_blocks_cannot_stay(smollm2_gguf_path, monkeypatch):
    method = GGUFMethod(dequantize=False)
    method.hf_config(smollm2_gguf_path)
    with pytest.raises(ValueError, match="dequantize=false: cannot keep .* tensor parallelism"):
        method._decide(tp_size=2)


def test_auto_dequantizes_under_tensor_parallelism_and_says_why(smollm2_gguf_path, caplog):
    method = GGUFMethod(dequantize="auto")
    method.hf_config(smollm2_gguf_path)
    with caplog.at_level(logging.INFO, logger="radixserve_quant_gguf.method"):
        assert method._decide(tp_size=2) is False
    assert "dequantized to fp32 at load: tensor parallelism (tp_size 2)" in caplog.text


def test_auto_dequantizes_without_the_native_kernels(smollm2_gguf_path, caplog, monkeypatch):
    monkeypatch.setattr(kernels, "load", lambda: None)  # no compiler, or RADIXSERVE_NATIVE=0
    method = GGUFMethod(dequantize="auto")
    method.hf_config(smollm2_gguf_path)
    with caplog.at_level(logging.INFO, logger="radixserve_quant_gguf.method"):
        assert method._decide(tp_size=1) is False
    assert "dequantized to fp32 at load: the native block kernels could not be built here" in caplog.text


def _tiny_gguf_model(tiny_llama_dir, tmp_path, qtypes, options, caplog):
    """The model a runner loads from a tiny Llama GGUF whose 2-D tensors (but the F16 embedding)
    are `qtypes` in turn, and the plugin's log of the path it took."""
    path = str(tmp_path / f"tiny-{'-'.join(qtypes)}.gguf")
    _write_tiny_gguf(tiny_llama_dir("llama", tie_word_embeddings=False), path, qtypes)
    with caplog.at_level(logging.INFO, logger="radixserve_quant_gguf.method"):
        model = _runner(path, options).model
    return model, [r.getMessage() for r in caplog.records if r.name == "radixserve_quant_gguf.method"]


@pytest.mark.parametrize(("qtypes", "why"), [
    (("Q4_1",), None),
    (("Q8_0", "Q4_1", "Q4_0"), r"the linears mix block types \(blk\.\d\.\w+\.weight is Q4_0, .* is Q4_1, .* is Q8_0\)"),
    (("F16",), r"blk\.0\.ffn_down\.weight is F16; the kernels keep files whose linears are all one of Q4_0, Q4_1, Q8_0"),
], ids=["Q4_1", "mixed", "F16"])
def test_auto_keeps_one_kept_type_else_dequantizes_naming_why(tiny_llama_dir, tmp_path, caplog, qtypes, why):
    model, log = _tiny_gguf_model(tiny_llama_dir, tmp_path, qtypes, "auto", caplog)
    weight = model.model.layers[0].mlp.gate_up_proj.weight
    assert len(log) == 1, log  # one line says which path
    if why is None:
        assert weight.dtype == torch.uint8 and model.lm_head.weight.dtype == torch.uint8  # the file's own head
        assert "Q4_1 weights kept quantized" in log[0] and "dequantize: true" in log[0]
    else:
        assert weight.dtype == torch.float32
        assert re.search("dequantized to fp32 at load: " + why, log[0]), log[0]
        with pytest.raises(ValueError, match="dequantize=false: cannot keep .*" + why):
            _runner(str(tmp_path / f"tiny-{'-'.join(qtypes)}.gguf"), False)


@pytest.mark.parametrize("option", [None, True], ids=["default", "true"])
def test_dequantize_true_is_the_default_and_gives_fp32_on_a_keepable_file(tiny_llama_dir, tmp_path, caplog, option):
    model, log = _tiny_gguf_model(tiny_llama_dir, tmp_path, ("Q4_1",), option, caplog)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert log == ["GGUF tiny-Q4_1.gguf: dequantized to fp32 at load (weight_source_options dequantize: true)"]


def _scheduled(runner, prompts, n_new, table=None):
    """Greedy outputs through the scheduler, all requests together; with `table`, speculative:
    4-token drafts from the known continuations with a random wrong suffix (partial acceptance)."""
    cfg = Config.build({"speculative": {"num_draft_tokens": 4}, "scheduler": {"max_total_tokens": 2048}})
    reg = Registry.discover()
    cache = reg.load("prefix_cache", "radix")(runner.req_to_token_pool, runner.token_allocator)
    drafter = None if table is None else TableDrafter(drafter_info(cfg, runner), table=table, mode="mixed", seed=1)
    sched = Scheduler(cfg, runner, cache, reg.load("policy", "fcfs")(), drafter=drafter)
    for i, p in enumerate(prompts):
        sp = SamplingParams(max_new_tokens=n_new, temperature=0, ignore_eos=True)
        sched.add_request(GenerateRequest(rid=f"r{i}", input_ids=p, sampling_params=sp))
    out: dict[str, list[int]] = {}
    while sched.has_work():
        for o in sched.step():
            out.setdefault(o.rid, []).extend(o.new_ids)
    assert sched.flush_cache()
    return [out[f"r{i}"] for i in range(len(prompts))], sched.stats()


def test_smollm2_kept_speculative_equals_plain_decoding(smollm2_pair):
    """Kept blocks amplify a 1-ulp difference of an activation into a whole int8 step, so a verify
    extend (several rows) must compute each row exactly as a decode does (attention included)."""
    kept, _ = smollm2_pair
    prompts = [apply_chat_template(kept.tokenizer, [{"role": "user", "content": q}]) for q in QUESTIONS]
    plain, _ = _scheduled(kept, prompts, 16)
    spec, stats = _scheduled(kept, prompts, 16, {tuple(p): out for p, out in zip(prompts, plain, strict=True)})
    assert stats["spec_accepted_tokens"] > 0
    assert spec == plain


def test_smollm2_kept_logits_same_bits_in_decode_and_in_an_extend(smollm2_pair):
    """The logits of a position are the same bits whether it is decoded alone or is a row of an
    extend over the tokens before it (a prefill, a speculative verify): every layer row-invariant."""
    kept, _ = smollm2_pair
    prompt = apply_chat_template(kept.tokenizer, [{"role": "user", "content": QUESTIONS[0]}])
    decoded = greedy_generate(kept, [prompt], 8, keep_logits=True)[0]
    for k in (1, 4, 7):  # decode step k vs the last row of a prefill of the prompt and k generated tokens
        extended = greedy_generate(kept, [prompt + decoded.tokens[:k]], 1, keep_logits=True)[0]
        assert torch.equal(extended.logits[0], decoded.logits[k]), f"step {k}"


def test_smollm2_kept_flat_layers_same_bits_as_the_module_calls(smollm2_pair):
    """The flat layer forward (flat_decoder.py over fast_layer.py's linears) is the same kernels in the same order as the layer
    modules: a prefill and decode steps give the same logits, bit for bit, with either."""
    kept, _ = smollm2_pair
    prompt = apply_chat_template(kept.tokenizer, [{"role": "user", "content": QUESTIONS[2]}])
    flat = greedy_generate(kept, [prompt], 4, keep_logits=True)[0]
    layers = list(kept.model.model.layers)
    saved = [layer.__dict__.pop("forward") for layer in layers]  # back to PreNormDecoderLayer.forward
    try:
        modules = greedy_generate(kept, [prompt], 4, keep_logits=True)[0]
    finally:
        for layer, forward in zip(layers, saved, strict=True):
            layer.forward = forward
    assert flat.tokens == modules.tokens
    assert all(torch.equal(a, b) for a, b in zip(flat.logits, modules.logits, strict=True))
