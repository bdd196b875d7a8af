"""`radixserve.static_batch`: the one loop that drives a ModelRunner outside the scheduler (CLI
generate, warm-up, bench one-batch, model tests), on a tiny checkpoint (CPU)."""

from __future__ import annotations

import pytest
from radixserve.config import Config
from radixserve.model_runner import ModelRunner
from radixserve.state import SamplingParams
from radixserve.static_batch import StaticBatch, run_static_batch

PROMPTS = [[3, 1, 4, 1, 5, 9], [9, 2, 6, 5, 3, 5], [5, 3, 5, 8, 9, 7]]


@pytest.fixture(scope="module")
def runner(tiny_llama_dir):
    cfg = Config.build({
        "model": {"path": tiny_llama_dir("llama")},
        "runtime": {"device": "cpu", "num_threads": 1},
        "scheduler": {"max_total_tokens": 1024, "max_running_requests": 4},
    })
    return ModelRunner(cfg, show_progress=False)


def all_free(runner) -> bool:
    pool, alloc = runner.req_to_token_pool, runner.token_allocator
    return alloc.available_size() == alloc.size and pool.available_size() == pool.size


def test_sampled_greedy_matches_the_logits_argmax_and_chunked_prefill(runner):
    sampled = run_static_batch(runner, PROMPTS, max_new_tokens=6)
    from_logits = run_static_batch(runner, PROMPTS, max_new_tokens=6, keep_logits=True)
    chunked = run_static_batch(runner, PROMPTS, max_new_tokens=6, prefill_chunk=2)
    assert sampled.output_ids == from_logits.output_ids == chunked.output_ids
    assert all(len(ids) == 6 for ids in sampled.output_ids)
    assert [len(rows) for rows in from_logits.logits] == [6, 6, 6]
    assert len(sampled.decode_step_s) == 5 and sampled.prefill_s > 0
    assert all_free(runner)


def test_a_prompt_that_hits_a_stop_token_leaves_the_batch(runner):
    ref = run_static_batch(runner, PROMPTS, max_new_tokens=6).output_ids
    stop = ref[0][1]  # prompt 0 stops at its second token; the others go on unless they make it too
    res = run_static_batch(runner, PROMPTS, SamplingParams(temperature=0, max_new_tokens=6, stop_token_ids=[stop]))
    for want, got in zip(ref, res.output_ids, strict=True):
        cut = want.index(stop) + 1 if stop in want else len(want)
        assert got == want[:cut]
    assert all_free(runner)


def test_stopping_early_gives_the_memory_back(runner):
    steps = StaticBatch(runner, PROMPTS[:1], max_new_tokens=50).steps()
    assert len(next(steps)) == 1
    steps.close()
    assert all_free(runner)


def test_a_batch_that_does_not_fit_says_so_and_leaks_nothing(runner):
    with pytest.raises(RuntimeError, match="max_total_tokens"):
        run_static_batch(runner, [[1] * 600, [2] * 600], max_new_tokens=2)
    assert all_free(runner)
