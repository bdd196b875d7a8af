"""The Engine end to end on the real SmolLM2-135M-Instruct GGUF: processes, batching, streaming, abort,
errors, and failing fast when a child process dies. One engine for the module (loading costs time);
the child-death test runs last because it kills that engine."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
from radixserve.engine import Engine
from radixserve.runtime.errors import EngineDeadError, RequestError

pytestmark = pytest.mark.slow

GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def engine():
    eng = Engine(
        scheduler={"max_total_tokens": 8192, "chunked_prefill_size": 64},
        # one torch thread: with two, OpenMP barriers spin against the other processes on a 2-core box
        runtime={"device": "cpu", "cuda_graph": False, "num_threads": 1},
    )
    pids = eng.tokenizer_manager.child_pids()
    yield eng
    eng.shutdown()
    for name, pid in pids.items():  # no orphans: every child is gone after shutdown
        with pytest.raises(ProcessLookupError):
            for _ in range(50):
                os.kill(pid, 0)
                time.sleep(0.1)
            raise AssertionError(f"{name} process {pid} outlived shutdown")


def drain_stats(engine, timeout=30.0) -> dict:
    """Stats once the scheduler has nothing resident (aborts are asynchronous)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = engine.get_stats()
        if (stats["running"] == 0 and stats["waiting"] == 0) or time.monotonic() > deadline:
            return stats
        time.sleep(0.05)


def test_32_concurrent_requests_of_mixed_lengths(engine):
    tok = engine.tokenizer
    topics = ["the sea", "a cat", "rain", "mountains", "coffee", "the moon", "trains", "bread"]
    prompts, params = [], []
    for i in range(32):
        if i % 2:
            msgs = [{"role": "user", "content": f"Write {1 + i % 3} sentences about {topics[i % 8]}." * (1 + i % 4)}]
            prompts.append(engine.tokenizer_manager.apply_chat_template(msgs))
        else:
            prompts.append(tok.encode(f"Fact {i}: " + "The history of " + topics[i % 8] * (1 + i % 5)))
        params.append({**GREEDY, "max_new_tokens": 4 + (i * 5) % 13})
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    assert len(outs) == 32
    for prompt, sp, out in zip(prompts, params, outs):
        meta = out["meta_info"]
        assert meta["finish_reason"]["type"] in ("length", "stop")
        assert meta["prompt_tokens"] == len(prompt)
        assert meta["completion_tokens"] == len(out["output_ids"]) <= sp["max_new_tokens"]
        if meta["finish_reason"]["type"] == "length":
            assert len(out["output_ids"]) == sp["max_new_tokens"]
        ids = out["output_ids"][:-1] if meta["finish_reason"]["type"] == "stop" else out["output_ids"]
        assert out["text"] == tok.decode(ids, skip_special_tokens=True)
    stats = drain_stats(engine)
    assert stats["finished_requests"] >= 32 and stats["generated_tokens"] > 0
    # the chat prompts share the template's system prompt: the radix cache served part of them
    assert stats["prefill_tokens_cached"] > 0


def test_same_prompt_twice_hits_the_cache_and_gives_the_same_greedy_text(engine):
    prompt = "Here is a short list of fruits: apple, banana,"
    a = engine.generate(prompt, {**GREEDY, "max_new_tokens": 8})
    b = engine.generate(prompt, {**GREEDY, "max_new_tokens": 8})
    assert a["output_ids"] == b["output_ids"]
    assert b["meta_info"]["cached_tokens"] == b["meta_info"]["prompt_tokens"] - 1


def test_streaming_yields_text_incrementally(engine):
    prompt = "Once upon a time, in a small village,"

    async def consume():
        chunks = []
        async for out in await engine.async_generate(
            prompt, {**GREEDY, "max_new_tokens": 20, "ignore_eos": True}, stream=True
        ):
            chunks.append(out)
        return chunks

    chunks = asyncio.run(consume())
    assert len(chunks) >= 10  # one item per step (stream_interval 1), not one at the end
    for prev, cur in zip(chunks, chunks[1:]):
        assert cur["text"].startswith(prev["text"])
        assert cur["output_ids"][: len(prev["output_ids"])] == prev["output_ids"]
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length"}
    whole = engine.generate(prompt, {**GREEDY, "max_new_tokens": 20, "ignore_eos": True})
    assert chunks[-1]["output_ids"] == whole["output_ids"] and chunks[-1]["text"] == whole["text"]


def test_abort_mid_stream(engine):
    async def consume():
        chunks = []
        stream = await engine.async_generate(
            "Count from one to one thousand:",
            {**GREEDY, "max_new_tokens": 400, "ignore_eos": True},
            stream=True,
            rid="abort-me",
        )
        async for out in stream:
            chunks.append(out)
            if len(chunks) == 3:
                engine.abort("abort-me")
        return chunks

    chunks = asyncio.run(consume())
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "abort"}
    assert 3 <= chunks[-1]["meta_info"]["completion_tokens"] < 400
    stats = drain_stats(engine)
    assert stats["running"] == 0 and stats["waiting"] == 0
    assert engine.flush_cache()
    assert engine.get_stats()["free_tokens"] == engine.get_stats()["max_total_tokens"]


def test_closing_a_stream_early_aborts_the_request(engine):
    async def take_two():
        stream = await engine.async_generate(
            "Tell me a long story.", {**GREEDY, "max_new_tokens": 400, "ignore_eos": True}, stream=True
        )
        got = []
        async for out in stream:
            got.append(out)
            if len(got) == 2:
                break
        await stream.aclose()
        return got

    assert len(asyncio.run(take_two())) == 2
    assert drain_stats(engine)["running"] == 0  # the scheduler dropped it instead of decoding 400 tokens


def test_stop_string_and_logprobs(engine):
    prompt = "The days of the week are Monday, Tuesday,"
    full = engine.generate(prompt, {**GREEDY, "max_new_tokens": 16, "ignore_eos": True})
    words = full["text"].split()
    assert len(words) >= 3
    stop = words[2]
    cut = engine.generate(
        prompt, {**GREEDY, "max_new_tokens": 16, "ignore_eos": True, "stop": [stop]}, return_logprob=True
    )
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert cut["text"] == full["text"][: full["text"].index(stop)]
    lps = cut["meta_info"]["output_token_logprobs"]
    assert [t for _, t in lps] == cut["output_ids"] and all(lp <= 0 for lp, _ in lps)


def test_a_stop_string_finishes_the_request_in_the_scheduler(engine):
    """Counted as finished (not aborted), no decoding past the stop, and the stop string's tokens
    and logprobs are not returned."""
    prompt = "The days of the week are Monday, Tuesday,"
    full = engine.generate(prompt, {**GREEDY, "max_new_tokens": 8, "ignore_eos": True})
    stop = full["text"].split()[1]
    before = drain_stats(engine)
    cut = engine.generate(
        prompt, {**GREEDY, "max_new_tokens": 2000, "ignore_eos": True, "stop": [stop]}, return_logprob=True
    )
    after = drain_stats(engine)
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert after["finished_requests"] == before["finished_requests"] + 1
    assert after["aborted_requests"] == before["aborted_requests"]
    assert after["generated_tokens"] - before["generated_tokens"] <= 8  # not 2000, not one step more
    lps = cut["meta_info"]["output_token_logprobs"]
    assert [t for _, t in lps] == cut["output_ids"]
    assert stop not in engine.tokenizer_manager.tokenizer.decode(cut["output_ids"])
    assert len(cut["output_ids"]) < cut["meta_info"]["completion_tokens"]


def test_invalid_requests_get_clear_errors(engine):
    with pytest.raises(RequestError, match="context length") as e:
        engine.generate(input_ids=[1] * 100, sampling_params={"max_new_tokens": engine.tokenizer_manager.context_len})
    assert e.value.status == 400
    with pytest.raises(ValueError, match="unknown sampling parameter"):
        engine.generate("hi", {"max_tokens": 3})
    assert engine.is_healthy()


def test_prompt_logprobs_through_the_engine(engine):
    ids = engine.tokenizer.encode("The capital of France is Paris")
    whole = engine.generate(input_ids=ids, sampling_params={**GREEDY, "max_new_tokens": 1, "prompt_logprobs": 1})
    scored = whole["meta_info"]["input_token_logprobs"]
    assert [t for _, t in scored] == ids and scored[0][0] is None
    assert all(isinstance(lp, float) and lp <= 0 for lp, _ in scored[1:])
    assert len(whole["meta_info"]["input_top_logprobs"]) == len(ids)
    # SGLang's form: from position 2 on, beside the output's logprobs
    part = engine.generate(input_ids=ids, sampling_params={**GREEDY, "max_new_tokens": 1}, return_logprob=True,
                           logprob_start_len=2)
    assert [t for _, t in part["meta_info"]["input_token_logprobs"]] == ids[2:]
    for (a, _), (b, _) in zip(part["meta_info"]["input_token_logprobs"], scored[2:], strict=True):
        assert a == pytest.approx(b, abs=1e-4)
    assert len(part["meta_info"]["output_token_logprobs"]) == 1
    with pytest.raises(ValueError, match="logprob_start_len"):
        engine.generate(input_ids=ids, sampling_params=GREEDY, logprob_start_len=0)  # needs return_logprob


def test_zz_a_dead_scheduler_fails_requests_fast(engine):
    """Runs last: it kills the module's engine."""

    async def long_stream():
        stream = await engine.async_generate(
            "Go on forever:", {"max_new_tokens": 1000, "ignore_eos": True}, stream=True
        )
        async for out in stream:
            if out["output_ids"]:
                os.kill(engine.tokenizer_manager.child_pids()["scheduler"], signal.SIGKILL)

    t0 = time.monotonic()
    with pytest.raises(EngineDeadError, match="scheduler process exited"):
        asyncio.run(long_stream())
    assert time.monotonic() - t0 < 60
    assert not engine.is_healthy()
    with pytest.raises(EngineDeadError):
        engine.generate("hello", {"max_new_tokens": 2})


def test_the_model_argument_may_be_the_whole_model_section(tmp_path):
    """`Engine(model=...)` takes the name `model`, so a `model=` section (tokenizer, impl, ...) could
    not be given: an outsider serving a plugin's file format needs model.tokenizer."""
    from radixserve.engine import engine_config

    cfg = engine_config({"path": "w.rsw", "tokenizer": str(tmp_path), "impl": "native"}, None, None,
                        {"stack": {"policy": "lpm"}})
    assert (cfg.model.path, cfg.model.tokenizer, cfg.model.impl) == ("w.rsw", str(tmp_path), "native")
    assert cfg.stack.policy == "lpm"
    plain = engine_config("some/dir", None, 2, {})
    assert plain.model.path == "some/dir" and plain.model.tokenizer is None and plain.runtime.tp_size == 2
