"""Speculative decoding on the real SmolLM2-135M-Instruct (CPU): greedy outputs identical with
speculation on and off over a set of chat prompts, 16 concurrent and alone, chains and trees, with
the radix cache; and through the Engine's processes, acceptance stats in meta_info and stats."""

from __future__ import annotations

import pytest
from radixserve.config import Config
from radixserve.model_runner import ModelRunner
from radixserve.plugins.registry import Registry
from radixserve.runtime.messages import GenerateRequest
from radixserve.scheduler import Scheduler
from radixserve.scheduler.speculative.setup import drafter_info
from radixserve.state import SamplingParams
from radixserve.tokenizer import apply_chat_template
from test_speculative_model import TableDrafter

pytestmark = pytest.mark.slow

TOPICS = ["the sea", "a cat", "rain", "mountains", "coffee", "the moon", "trains", "bread"]
PASSAGE = "The quick brown fox jumps over the lazy dog while the farmer watches from the barn."


def chat_prompts(tok, n=32):
    out = []
    for i in range(n):
        if i % 3 == 0:
            msg = f"Repeat this sentence exactly: {PASSAGE}"
        else:
            msg = f"Write {1 + i % 3} sentences about {TOPICS[i % 8]}."
        out.append(apply_chat_template(tok, [{"role": "user", "content": msg}]))
    return out


@pytest.fixture(scope="module")
def runners(smollm2_gguf_path):
    built = {}

    def get(attention, bf16=False):
        if (attention, bf16) not in built:
            # bf16: stacks/cpu-bf16.yaml's settings (bf16 matmul inputs where the CPU has them, a bf16 KV pool)
            fast = {"cpu_matmul_precision": "medium", "kv_cache_dtype": "bfloat16"} if bf16 else {}
            cfg = Config.build({
                # dequantized at load (the default); kept blocks: tests/test_gguf_kept_quantized.py
                "model": {"path": smollm2_gguf_path, "weight_source_options": {"dequantize": True}},
                "stack": {"attention": attention},
                "runtime": {"device": "cpu", "num_threads": 1, **fast},
                "scheduler": {"max_total_tokens": 12000, "max_running_requests": 40},
            })
            built[attention, bf16] = ModelRunner(cfg, show_progress=False)
        return built[attention, bf16]

    return get


def _run(runner, prompts, n_new, drafter_kwargs=None):
    cfg = Config.build({"speculative": {"num_draft_tokens": 4}, "scheduler": {"max_total_tokens": 12000}})
    reg = Registry.discover()
    cache = reg.load("prefix_cache", "radix")(runner.req_to_token_pool, runner.token_allocator)
    drafter = None if drafter_kwargs is None else TableDrafter(drafter_info(cfg, runner), **drafter_kwargs)
    sched = Scheduler(cfg, runner, cache, reg.load("policy", "fcfs")(), drafter=drafter)
    for i, p in enumerate(prompts):
        sp = SamplingParams(max_new_tokens=n_new, temperature=0)
        sched.add_request(GenerateRequest(rid=f"r{i}", input_ids=p, sampling_params=sp))
    res: dict[str, list[int]] = {}
    while sched.has_work():
        for out in sched.step():
            res.setdefault(out.rid, []).extend(out.new_ids)
    assert sched.flush_cache() and sched.allocator.available_size() == sched.allocator.size
    return res, sched.stats()


@pytest.mark.parametrize("attention,tree,bf16", [("cpu_batched", False, False), ("torch_native", True, False),
                                                ("cpu_batched", True, True), ("cpu_batched", False, True), ("cpu_batched", True, False)])
def test_smollm2_greedy_identical_with_speculation(runners, attention, tree, bf16):
    runner = runners(attention, bf16)
    prompts = chat_prompts(runner.tokenizer, n=16)  # a batch of mixed lengths and draft outcomes
    plain, _ = _run(runner, prompts, 20)
    table = {tuple(p): plain[f"r{i}"] for i, p in enumerate(prompts)}
    spec, stats = _run(runner, prompts, 20, {"table": table, "mode": "mixed", "tree": tree, "seed": 1})
    assert spec == plain
    assert stats["spec_accepted_tokens"] > 0
    alone, _ = _run(runner, prompts[:1], 20, {"table": table, "mode": "right", "tree": tree})
    assert alone["r0"] == plain["r0"]


def test_engine_reports_acceptance_in_meta_info_and_stats(smollm2_gguf_path):
    from radixserve.engine import Engine

    with Engine(model=smollm2_gguf_path, stack={"speculative": "oracle"},
                runtime={"device": "cpu", "cuda_graph": False, "num_threads": 1}) as eng:
        prompts = chat_prompts(eng.tokenizer, n=4)
        params = {"temperature": 0, "max_new_tokens": 17}
        first = eng.generate(input_ids=prompts, sampling_params=params)
        for o in first:  # nothing learned yet: no draft, no verify step, and the keys are there all the same
            assert o["meta_info"]["spec_verify_ct"] == 0 and o["meta_info"]["spec_accept_length"] == 0.0
        second = eng.generate(input_ids=prompts, sampling_params=params)  # the oracle learned the first
        assert [o["output_ids"] for o in second] == [o["output_ids"] for o in first]
        for o in second:
            meta = o["meta_info"]
            if meta["completion_tokens"] > 1:
                assert meta["spec_verify_ct"] >= 1 and meta["spec_accept_length"] > 1.0
        stats = eng.get_stats()
        assert stats["speculative"] and stats["spec_verifies"] > 0 and stats["spec_accept_length"] > 1.0
