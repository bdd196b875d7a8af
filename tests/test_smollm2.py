"""The real SmolLM2-135M-Instruct (GGUF Q4_1, dequantized at load) against transformers loading the same file."""

from __future__ import annotations

import itertools
import os

import pytest
from hf_background import BackgroundReference
from hf_reference import first_divergence, top5_rule_holds_ids
from radixserve.config import Config
from radixserve.model_runner import ModelRunner
from radixserve.tokenizer import apply_chat_template
from runner_driver import greedy_generate

pytestmark = pytest.mark.slow

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three primary colors.",
    "How many legs does a spider have?",
    "Explain what a CPU does in one sentence.",
    "Translate 'good morning' into Spanish.",
    "What is 12 times 7?",
    "Name a famous physicist.",
]
NEW_TOKENS = 64
# ~900 tokens: long enough for the flash path of the bf16 attention (FLASH_MIN_EXTEND) and several key blocks
LONG_QUESTION = " ".join(f"Box {i} is {color} and holds {3 * i + 1} apples." for i, color in
                         zip(range(70), itertools.cycle(["red", "green", "blue", "white", "black"]))) + \
    " How many apples does box 41 hold?"


@pytest.fixture(scope="module", autouse=True)
def hf_reference(smollm2_gguf_path, tmp_path_factory):
    """transformers' greedy tokens on the same file, computed in a child process while the
    module's other tests run (the model is loaded with one torch thread: the other core is free)."""
    ref = BackgroundReference(smollm2_gguf_path, QUESTIONS, NEW_TOKENS, tmp_path_factory.mktemp("hf-reference"))
    yield ref
    ref.close()


@pytest.fixture(scope="module")
def runner(smollm2_gguf_path) -> ModelRunner:
    cfg = Config.build({
        # dequantized at load: the fp32 path transformers computes (kept blocks: test_gguf_kept_quantized.py)
        "model": {"path": smollm2_gguf_path, "weight_source_options": {"dequantize": True}},
        "runtime": {"device": "cpu", "dtype": "float32", "num_threads": 1},  # no OpenMP oversubscription
        "scheduler": {"max_total_tokens": 4096, "max_running_requests": 8},
    })
    return ModelRunner(cfg, show_progress=False)


@pytest.fixture(scope="module")
def prompts(runner) -> list[list[int]]:
    return [apply_chat_template(runner.tokenizer, [{"role": "user", "content": q}]) for q in QUESTIONS]


@pytest.fixture(scope="module")
def batched(runner, prompts):
    return greedy_generate(runner, prompts, NEW_TOKENS, keep_logits=True)


def test_loads_from_gguf(runner):
    assert type(runner.model).__name__ == "LlamaForCausalLM"
    assert runner.vocab_size == 49152 and runner.hf_config.max_position_embeddings == 8192
    assert runner.context_len == 4096  # capped at the fixture's 4096-token KV pool (one request must fit it)
    assert runner.model.lm_head.weight is runner.model.model.embed_tokens.weight  # tied
    assert 2 in runner.eos_token_ids


def test_tokenizer_and_chat_template_match_transformers(smollm2_gguf_path, runner, prompts):
    """Our (possibly cached) GGUF tokenizer renders and tokenizes exactly like transformers' own."""
    from transformers import AutoTokenizer

    d, f = os.path.split(smollm2_gguf_path)
    ref = AutoTokenizer.from_pretrained(d, gguf_file=f)
    for q, ids in zip(QUESTIONS, prompts, strict=True):
        want = ref.apply_chat_template([{"role": "user", "content": q}], tokenize=True, add_generation_prompt=True,
                                       return_dict=False)
        assert ids == list(want)
    text = "  naïve café 中文 😀\tend"
    assert runner.tokenizer.encode(text) == ref.encode(text)
    assert runner.tokenizer.decode(prompts[0]).endswith("<|im_start|>assistant\n")


def test_names_paris(runner, batched):
    answer = runner.tokenizer.decode(batched[0].tokens)
    assert "Paris" in answer, answer


def test_batch_invariance(runner, prompts, batched):
    """Each request's greedy output is the same alone as inside the 8-request batch."""
    for i in (0, 5):
        alone = greedy_generate(runner, [prompts[i]], NEW_TOKENS)[0].tokens
        assert alone == batched[i].tokens, f"request {i} differs alone vs batched"


def test_generate_loop_stops_at_eos_and_frees_kv(runner, prompts, batched):
    """The CLI's in-process loop: same greedy tokens, stops at EOS, gives every slot back."""
    from radixserve.cli_generate import generate_ids
    from radixserve.state import SamplingParams

    out = list(generate_ids(runner, prompts[0], SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0)))
    assert out == batched[0].tokens[: len(out)]
    assert out[-1] in runner.eos_token_ids or len(out) == NEW_TOKENS
    assert runner.token_allocator.available_size() == runner.token_allocator.size
    assert runner.req_to_token_pool.available_size() == runner.req_to_token_pool.size


def test_greedy_matches_transformers_gguf(prompts, batched, hf_reference):
    for prompt, got, ref in zip(prompts, batched, hf_reference.result(), strict=True):
        assert ref["prompt"] == prompt  # the same input on both sides
        i = first_divergence(got.tokens, ref["tokens"])
        assert top5_rule_holds_ids(got.tokens, got.logits, ref["tokens"], ref["top5"]), f"top-5 rule broken at {i}"
        assert got.tokens == ref["tokens"], f"greedy diverges at step {i}"


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "bfloat16"])
def test_bf16_matmuls_keep_the_top5_rule(smollm2_gguf_path, prompts, hf_reference, kv_cache_dtype):
    """runtime.cpu_matmul_precision=medium (bf16 GEMM inputs, fp32 sums) on the real model, with the
    fp32 pool or a bf16 one (then the attention's products are bf16 too: stacks/cpu-bf16.yaml): every
    answer still follows transformers' fp32 one under the top-5 rule, and a request's tokens do
    not depend on its batch."""
    from radixserve.layers import cpu_gemm

    if not cpu_gemm.bf16_available():
        pytest.skip("no native GEMM here: medium precision stays fp32")
    cfg = Config.build({
        "model": {"path": smollm2_gguf_path, "weight_source_options": {"dequantize": True}},
        "runtime": {"device": "cpu", "dtype": "float32", "num_threads": 1, "cpu_matmul_precision": "medium",
                    "kv_cache_dtype": kv_cache_dtype},
        "scheduler": {"max_total_tokens": 4096, "max_running_requests": 8},
    })
    medium = ModelRunner(cfg, show_progress=False)
    assert medium.model.model.layers[0].mlp.gate_up_proj.packed_weight.bf16
    kernels = medium.attn_backend._kernels  # its bf16 products need AVX-512 BF16 (the GEMMs' widened panels do not)
    assert medium.attn_backend._bf16_products == (kv_cache_dtype == "bfloat16"
                                                  and getattr(kernels, "bf16_products_available", False))
    got = greedy_generate(medium, prompts, NEW_TOKENS, keep_logits=True)
    same = 0
    for prompt, g, ref in zip(prompts, got, hf_reference.result(), strict=True):
        assert ref["prompt"] == prompt
        i = first_divergence(g.tokens, ref["tokens"])
        assert top5_rule_holds_ids(g.tokens, g.logits, ref["tokens"], ref["top5"]), f"top-5 rule broken at {i}"
        same += g.tokens == ref["tokens"]
    # alone as in the batch, for each way of taking greedy tokens: from the logits, and from the greedy
    # screen, whose exact fp32 argmax may pick another token than the bf16 products' logits at a near tie
    # (session 38: at step 31 of this prompt with the AMX GEMMs)
    assert greedy_generate(medium, [prompts[3]], NEW_TOKENS, keep_logits=True)[0].tokens == got[3].tokens
    screened = greedy_generate(medium, prompts, NEW_TOKENS)
    assert greedy_generate(medium, [prompts[3]], NEW_TOKENS)[0].tokens == screened[3].tokens
    print(f"medium precision, kv {kv_cache_dtype}: {same} of {len(prompts)} answers identical to transformers' fp32 ones")


def test_long_prompt_with_bf16_attention_keeps_the_top5_rule(smollm2_gguf_path, tmp_path):
    """A ~900-token prompt under medium precision with a bf16 pool, whole and in 256-token chunks (the
    attention kernel's flash path, from scratch and after a cached prefix), against transformers' fp32
    greedy answer on the same file: the top-5 rule holds for both."""
    from radixserve.layers import cpu_gemm

    if not cpu_gemm.bf16_available():
        pytest.skip("no native GEMM here: medium precision stays fp32")
    reference = BackgroundReference(smollm2_gguf_path, [LONG_QUESTION], 16, tmp_path)
    try:
        cfg = Config.build({
            "model": {"path": smollm2_gguf_path, "weight_source_options": {"dequantize": True}},
            "runtime": {"device": "cpu", "dtype": "float32", "num_threads": 1, "cpu_matmul_precision": "medium",
                        "kv_cache_dtype": "bfloat16"},
            "scheduler": {"max_total_tokens": 4096, "max_running_requests": 2},
        })
        medium = ModelRunner(cfg, show_progress=False)
        prompt = apply_chat_template(medium.tokenizer, [{"role": "user", "content": LONG_QUESTION}])
        assert len(prompt) > 800
        runs = {chunk: greedy_generate(medium, [prompt], 16, keep_logits=True, prefill_chunk=chunk)[0]
                for chunk in (None, 256)}
        ref = reference.result()[0]
    finally:
        reference.close()
    assert ref["prompt"] == prompt
    for chunk, got in runs.items():
        i = first_divergence(got.tokens, ref["tokens"])
        assert top5_rule_holds_ids(got.tokens, got.logits, ref["tokens"], ref["top5"]), (
            f"chunk {chunk}: top-5 rule broken at {i}")
