"""Scheduler behaviour on the toy runner (radixserve.testing): outputs, memory, aborts.

Every scheduler built here is checked at teardown: nothing waiting or running, the cache flushes,
and every KV slot and request row is back in its free list."""

from __future__ import annotations

import logging
import random

import pytest
from radixserve.config import Config
from radixserve.plugins.registry import Registry
from radixserve.runtime.messages import GenerateRequest
from radixserve.scheduler import Scheduler
from radixserve.state import SamplingParams
from radixserve.testing import ToyRunner, toy_next_token

VOCAB = 1000


def reference(prompt: list[int], max_new: int, stop_ids=(), min_new: int = 0) -> list[int]:
    ids, out = list(prompt), []
    while len(out) < max_new:
        tok = toy_next_token(ids, VOCAB)
        out.append(tok)
        ids.append(tok)
        if tok in stop_ids and len(out) >= min_new:
            break
    return out


@pytest.fixture(params=[False, True], ids=["sync", "overlap"])
def make_scheduler(request):
    """Every scheduler test runs twice: plain, and with overlap scheduling (launch ahead)."""
    built: list[Scheduler] = []

    def make(cache="radix", policy="fcfs", runner_kwargs=None, **scheduler) -> Scheduler:
        runner = ToyRunner(vocab_size=VOCAB, **(runner_kwargs or {}))
        config = Config.build(
            {
                "stack": {"prefix_cache": cache, "policy": policy},
                "scheduler": scheduler,
                "runtime": {"overlap": request.param},
            }
        )
        sched = Scheduler.from_config(config, runner, Registry.discover())
        built.append(sched)
        return sched

    yield make
    for s in built:
        assert_nothing_left(s)


def assert_nothing_left(s: Scheduler) -> None:
    assert not s.waiting and not s.running and s.chunked_req is None, "a request was left behind"
    assert s.flush_cache()
    assert s.allocator.available_size() == s.allocator.size, "KV slots leaked"
    assert s.req_to_token_pool.available_size() == s.req_to_token_pool.size, "request rows leaked"


def request(rid: str, prompt: list[int], max_new: int, stream=False, **sp) -> GenerateRequest:
    return GenerateRequest(
        rid=rid,
        input_ids=prompt,
        sampling_params=SamplingParams(max_new_tokens=max_new, temperature=0, **sp),
        stream=stream,
    )


def run_to_completion(sched: Scheduler, max_steps: int = 100_000) -> dict[str, dict]:
    """Step until idle; per rid: ids (concatenated emissions), finish reason, number of emissions."""
    results: dict[str, dict] = {}
    for _ in range(max_steps):
        if not sched.has_work():
            return results
        for out in sched.step():
            r = results.setdefault(out.rid, {"ids": [], "finish": None, "emissions": 0, "outs": []})
            assert r["finish"] is None, f"{out.rid} emitted after finishing"
            r["ids"] += out.new_ids
            r["finish"] = out.finished_reason
            r["emissions"] += 1
            r["outs"].append(out)
    raise AssertionError("scheduler did not go idle")


def workload(seed: int = 0, n: int = 24) -> list[tuple[str, list[int], int]]:
    """Mixed lengths, some shared prefixes (so a sharing cache gets hits)."""
    rng = random.Random(seed)
    shared = [rng.randrange(VOCAB) for _ in range(40)]
    reqs = []
    for i in range(n):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(3, 120))]
        if i % 3 == 0:
            prompt = shared + prompt
        reqs.append((f"r{i}", prompt, rng.randint(1, 40)))
    # exact repeats: a cache can match the whole prompt, and one token must still be computed
    reqs.append(("dup0", reqs[1][1], 7))
    reqs.append(("dup1", reqs[1][1], 30))
    return reqs


def run_workload(sched: Scheduler, reqs) -> dict[str, dict]:
    for rid, prompt, max_new in reqs:
        sched.add_request(request(rid, prompt, max_new))
    return run_to_completion(sched)


CONFIGS = {
    "radix": dict(cache="radix"),
    "chunk-cache": dict(cache="chunk"),
    "radix-chunked16": dict(cache="radix", chunked_prefill_size=16),
    "chunk-cache-chunked16": dict(cache="chunk", chunked_prefill_size=16),
    "radix-no-chunking": dict(cache="radix", chunked_prefill_size=-1),
    "radix-mixed": dict(cache="radix", chunked_prefill_size=16, enable_mixed_chunk=True),
    "small-batches": dict(cache="radix", max_prefill_tokens=64, max_running_requests=3),
}
# every in-tree policy must keep greedy outputs (an installed third-party one is checked by its own
# conformance kit run: tests/test_example_plugin.py installs and removes one while this suite runs)
_REGISTRY = Registry.discover()
POLICIES = [n for n in _REGISTRY.names("policy") if _REGISTRY.get("policy", n).distribution == "radixserve-policies"]


def test_the_policies_under_test_include_fcfs_and_lpm():
    assert {"fcfs", "lpm"} <= set(POLICIES)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_outputs_match_reference(make_scheduler, name):
    sched = make_scheduler(**CONFIGS[name])
    reqs = workload()
    results = run_workload(sched, reqs)
    assert sorted(results) == sorted(rid for rid, _, _ in reqs)  # none lost, none invented
    for rid, prompt, max_new in reqs:
        assert results[rid]["ids"] == reference(prompt, max_new), rid
        assert results[rid]["finish"] == {"type": "length"}
        assert results[rid]["emissions"] == 1  # not streamed: one output at the end


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("chunked", [-1, 16])
def test_every_policy_gives_the_same_greedy_outputs(make_scheduler, policy, chunked):
    sched = make_scheduler(cache="radix", policy=policy, chunked_prefill_size=chunked, max_prefill_tokens=256)
    reqs = workload(seed=3)
    results = run_workload(sched, reqs)
    assert sorted(results) == sorted(rid for rid, _, _ in reqs)
    for rid, prompt, max_new in reqs:
        assert results[rid]["ids"] == reference(prompt, max_new), rid
    assert sched.metrics.prefill_tokens_cached > 0


@pytest.mark.parametrize("cache,policy", [("radix", "fcfs"), ("radix", "lpm"), ("chunk", "fcfs")])
@pytest.mark.parametrize("chunked", [-1, 16])
def test_retraction_under_a_tiny_pool_keeps_outputs(make_scheduler, cache, policy, chunked):
    # 300 slots for 24 requests of up to 200 tokens each, admitted optimistically (a tiny reservation
    # for future tokens): decode runs out of memory and must retract to make progress
    sched = make_scheduler(
        cache=cache,
        policy=policy,
        chunked_prefill_size=chunked,
        schedule_conservativeness=0.05,
        runner_kwargs={"max_total_tokens": 300},
    )
    reqs = workload(seed=1)
    results = run_workload(sched, reqs)
    assert sched.metrics.retractions > 0, "the pool was meant to force retraction"
    assert sorted(results) == sorted(rid for rid, _, _ in reqs)
    for rid, prompt, max_new in reqs:
        assert results[rid]["ids"] == reference(prompt, max_new), rid


def test_radix_cache_shares_a_system_prompt(make_scheduler):
    rng = random.Random(7)
    system = [rng.randrange(VOCAB) for _ in range(256)]
    reqs = [(f"q{i}", system + [rng.randrange(VOCAB) for _ in range(16)], 8) for i in range(64)]
    computed = {}
    for cache in ("radix", "chunk"):
        sched = make_scheduler(cache=cache, runner_kwargs={"max_total_tokens": 32768, "max_running_requests": 64})
        results = run_workload(sched, reqs)
        for rid, prompt, max_new in reqs:
            assert results[rid]["ids"] == reference(prompt, max_new)
        computed[cache] = sched.stats()["prefill_tokens_computed"]
        assert computed[cache] == sched.runner.forward_tokens - sched.metrics.generated_tokens + 64
    assert computed["chunk"] == 64 * 272
    assert computed["radix"] <= 0.2 * computed["chunk"], computed


def test_stop_token_ids_and_min_new_tokens(make_scheduler):
    sched = make_scheduler()
    prompt = list(range(10, 30))
    ref = reference(prompt, 30)
    stop = ref[3]
    sched.add_request(request("a", prompt, 30, stop_token_ids=[stop]))
    sched.add_request(request("b", prompt, 30, stop_token_ids=[stop], min_new_tokens=10))
    results = run_to_completion(sched)
    assert results["a"]["ids"] == ref[: ref.index(stop) + 1]
    assert results["a"]["finish"] == {"type": "stop", "matched": stop}
    assert results["b"]["ids"] == reference(prompt, 30, stop_ids=[stop], min_new=10)
    assert len(results["b"]["ids"]) >= 10


def test_eos_ends_a_request_unless_ignore_eos(make_scheduler):
    prompt = list(range(50, 70))
    ref = reference(prompt, 20)
    eos = ref[5]
    sched = make_scheduler(runner_kwargs={"eos_token_ids": (eos,)})
    sched.add_request(request("eos", prompt, 20))
    sched.add_request(request("ignore", prompt, 20, ignore_eos=True))
    results = run_to_completion(sched)
    assert results["eos"]["ids"] == ref[: ref.index(eos) + 1]
    assert results["eos"]["finish"] == {"type": "stop", "matched": eos}
    assert results["ignore"]["ids"] == ref


def test_streaming_emits_every_stream_interval_tokens(make_scheduler):
    sched = make_scheduler(stream_interval=4)
    prompt = list(range(5, 25))
    sched.add_request(request("s", prompt, 13, stream=True))
    results = run_to_completion(sched)
    sizes = [len(o.new_ids) for o in results["s"]["outs"]]
    assert sizes == [1, 4, 4, 4]  # first token at once, then every 4, the last one with the finish
    assert results["s"]["ids"] == reference(prompt, 13)
    assert results["s"]["outs"][0].prompt_tail == prompt[-5:]
    assert all(o.prompt_tail is None for o in results["s"]["outs"][1:])


def test_logprobs_follow_their_tokens(make_scheduler):
    sched = make_scheduler()
    sched.add_request(request("lp", list(range(1, 9)), 6, logprobs=True, top_logprobs=2))
    results = run_to_completion(sched)
    out = results["lp"]["outs"][-1]
    assert len(out.token_logprobs) == len(out.new_ids) == 6
    for tok, lp, top in zip(out.new_ids, out.token_logprobs, out.top_logprobs):
        assert lp == pytest.approx(-0.1 * (tok % 7))
        assert top[0][0] == tok


@pytest.mark.parametrize("where", ["waiting", "running", "chunked"])
def test_abort_frees_everything(make_scheduler, where):
    sched = make_scheduler(chunked_prefill_size=16, max_prefill_tokens=64)
    prompt = list(range(100, 100 + (80 if where == "chunked" else 10)))
    sched.add_request(request("victim", prompt, 50))
    sched.add_request(request("other", list(range(300, 330)), 10))
    if where != "waiting":
        sched.step()  # "victim" is admitted first (whole, or as the chunked request)
        sched.step()
        if where == "chunked":
            assert sched.chunked_req.rid == "victim"
        else:
            assert "victim" in [r.rid for r in sched.running]
        assert sched.allocator.available_size() < sched.allocator.size
    assert sched.abort("victim")
    assert not sched.abort("victim")  # unknown now
    results = run_to_completion(sched)
    assert results["victim"]["finish"] == {"type": "abort"}
    assert results["other"]["ids"] == reference(list(range(300, 330)), 10)


def test_abort_right_after_admission_is_not_lost(make_scheduler):
    # with overlap the first step leaves the prompt's prefill in flight: the request is then in
    # neither waiting nor running, and its abort (a client disconnect) used to be dropped
    sched = make_scheduler()
    sched.add_request(request("victim", list(range(100, 110)), 30))
    sched.add_request(request("other", list(range(300, 330)), 10))
    sched.step()
    assert sched.abort("victim")
    results = run_to_completion(sched)
    assert results["victim"]["finish"] == {"type": "abort"} and len(results["victim"]["ids"]) <= 1
    assert results["other"]["ids"] == reference(list(range(300, 330)), 10)


def test_requests_that_cannot_fit_are_rejected_with_a_reason(make_scheduler):
    sched = make_scheduler(runner_kwargs={"max_total_tokens": 100, "context_len": 80})
    sched.add_request(request("ctx", list(range(70)), 20))
    sched.add_request(request("empty", [], 5))
    sched.add_request(request("ok", list(range(30)), 20))
    results = run_to_completion(sched)
    assert "context length (80 tokens)" in results["ctx"]["outs"][0].error
    assert results["empty"]["outs"][0].error == "input_ids: the prompt is empty"
    assert results["ok"]["ids"] == reference(list(range(30)), 20)
    assert sched.metrics.rejected_requests == 2
    big = make_scheduler(runner_kwargs={"max_total_tokens": 40, "context_len": 200})
    big.add_request(request("pool", list(range(30)), 20))
    results = run_to_completion(big)
    assert "KV cache capacity (40 tokens)" in results["pool"]["outs"][0].error


def test_flush_cache_refuses_while_requests_are_resident(make_scheduler):
    sched = make_scheduler()
    sched.add_request(request("x", list(range(40)), 5))
    sched.step()
    assert not sched.flush_cache()
    run_to_completion(sched)
    assert sched.cache.evictable_size() > 0  # the radix cache kept the finished request's KV
    assert sched.flush_cache()
    assert sched.allocator.available_size() == sched.allocator.size


def test_stats_report_usage_and_hits(make_scheduler):
    sched = make_scheduler()
    prompt = list(range(200, 260))
    sched.add_request(request("a", prompt, 4))
    run_to_completion(sched)
    sched.add_request(request("b", prompt, 4))
    sched.step()
    stats = sched.stats()
    assert stats["running"] == 1 and stats["waiting"] == 0
    assert stats["prefill_tokens_cached"] == 59  # all but the last prompt token came from the cache
    assert 0 < stats["token_usage"] <= 1 and stats["cache_hit_rate"] > 0.4
    assert stats["cuda_alloc_retries"] == 0  # a runner without a CUDA allocator reports none
    sched.runner.allocator_retries = lambda: 3  # ModelRunner's count on CUDA (torch's num_alloc_retries)
    assert sched.stats()["cuda_alloc_retries"] == 3
    # the prefix cache's own counters (PrefixCache.stats) ride along, numbers only
    assert stats["prefix_cache_hit_tokens"] >= 59 and stats["prefix_cache_queried_tokens"] >= 118
    sched.cache.stats = lambda: {"mine": 7, "note": "text", "flag": True}
    extra = {k: v for k, v in sched.stats().items() if k.startswith("prefix_cache_")}
    assert extra == {"prefix_cache_mine": 7}
    sched.cache.stats = lambda: 1 / 0  # a failing stats() costs only its own counters
    assert "running" in sched.stats() and not any(k.startswith("prefix_cache_") for k in sched.stats())
    run_to_completion(sched)


@pytest.mark.parametrize("mixed", [False, True])
def test_decodes_keep_running_while_a_long_prompt_is_chunked(make_scheduler, mixed):
    sched = make_scheduler(chunked_prefill_size=16, enable_mixed_chunk=mixed)
    short, long = list(range(10, 20)), list(range(500, 700))
    sched.add_request(request("short", short, 40))
    sched.step()  # prefill "short"
    sched.add_request(request("long", long, 5))
    decoded_while_chunking = 0
    while sched.has_work():
        was_chunking = sched.chunked_req is not None or any(r.rid == "long" for r in sched.waiting)
        before = next((len(r.output_ids) for r in sched.running if r.rid == "short"), None)
        sched.step()
        after = next((len(r.output_ids) for r in sched.running if r.rid == "short"), None)
        if was_chunking and before is not None and after is not None:
            decoded_while_chunking += after - before
    # 200 tokens in chunks of 16 take 13 chunk steps; "short" kept decoding during them
    assert decoded_while_chunking >= (12 if mixed else 6)
    if mixed:
        assert sched.metrics.mixed_batches > 0


@pytest.mark.parametrize("mixed", [False, True])
def test_a_short_prompt_arriving_during_a_chunked_prefill_starts_before_it_ends(make_scheduler, mixed):
    """A chat turn that arrives while a long prompt is chunked took its first token only after the whole long
    prefill (17 s behind a 4000-token prompt on a CPU): it now gets half of the next chunk, and the long prompt
    finishes at most a few steps later; outputs are unchanged."""
    sched = make_scheduler(chunked_prefill_size=16, enable_mixed_chunk=mixed)
    long, short = list(range(500, 700)), list(range(10, 16))
    sched.add_request(request("long", long, 3))
    sched.step()
    sched.step()  # two chunks of the long prompt
    sched.add_request(request("short", short, 4))
    first_token_step, long_done_step, step = {}, None, 0
    while sched.has_work():
        sched.step()
        step += 1
        for r in sched.running:
            if r.output_ids and r.rid not in first_token_step:
                first_token_step[r.rid] = step
        if long_done_step is None and sched.chunked_req is None and not any(r.rid == "long" for r in sched.waiting):
            long_done_step = step
    assert first_token_step["short"] <= 2, first_token_step  # the long prompt had 10+ chunks to go
    assert long_done_step <= 200 // 8 + 2
    assert sched.metrics.prefill_tokens_computed == len(long) + len(short)


def test_a_long_prompt_waiting_keeps_its_place_behind_a_chunked_one(make_scheduler):
    """Only prompts that fit half a chunk whole share it: a second long prompt waits for the chunked one, which
    then keeps whole chunks (no halving when nothing short waits)."""
    sched = make_scheduler(chunked_prefill_size=16)
    sizes = []
    launch = sched.runner.launch_batch

    def recording(sb):
        sizes.append(list(sb.extend_lens))
        return launch(sb)

    sched.runner.launch_batch = recording
    sched.add_request(request("long1", list(range(500, 600)), 2))
    sched.step()
    sched.add_request(request("long2", list(range(700, 800)), 2))
    run_to_completion(sched)
    prefill = [x for x in sizes if sum(x) > len(x)]
    assert all(sum(x) == 16 or x == prefill[-1] or len(x) == 2 for x in prefill), prefill
    assert all(len(x) == 1 for x in prefill[:6]), prefill  # long1 alone in full chunks


def test_mixed_batches_count_their_decode_rows_against_the_chunk(make_scheduler):
    # three requests decode while a 200-token prompt is chunked into mixed batches of 16 tokens: each
    # batch carries 13 prompt tokens and the 3 decode rows, never more than the chunk in all
    sched = make_scheduler(chunked_prefill_size=16, enable_mixed_chunk=True)
    for i in range(3):
        sched.add_request(request(f"short{i}", list(range(10 + i, 20 + i)), 60))
    sched.step()
    sizes = []
    launch = sched.runner.launch_batch

    def recording(sb):
        sizes.append((sum(sb.extend_lens), sum(1 for e in sb.extend_lens if e == 1), len(sb.extend_lens)))
        return launch(sb)

    sched.runner.launch_batch = recording
    sched.add_request(request("long", list(range(500, 700)), 3))
    while any(r.rid == "long" for r in sched.waiting) or sched.chunked_req is not None:
        sched.step()
    mixed = [s for s in sizes if s[2] > 1 and s[0] > s[2]]
    assert mixed, sizes
    assert all(total <= 16 for total, _, _ in sizes), sizes
    assert (16, 3, 4) in mixed  # 13 prompt tokens + 3 decode rows
    run_to_completion(sched)


@pytest.mark.parametrize("interleave", [False, True])
def test_interleave_decode_runs_a_decode_step_between_prefill_batches(make_scheduler, interleave):
    # six 16-token prompts arrive while "running" decodes; each prefill batch holds one prompt
    # (16-token chunks). Prefill-first scheduling admits them back to back while "running" waits;
    # scheduler.interleave_decode gives it a decode step after every prefill batch (online ITL).
    sched = make_scheduler(chunked_prefill_size=16, enable_mixed_chunk=False, interleave_decode=interleave)
    sched.add_request(request("running", list(range(10, 20)), 40))
    sched.step()
    prompts = {f"p{i}": list(range(100 + 20 * i, 116 + 20 * i)) for i in range(6)}
    for rid, prompt in prompts.items():
        sched.add_request(request(rid, prompt, 3))
    decoded_while_waiting, ids = 0, {rid: [] for rid in prompts}
    while sched.has_work():
        waiting = any(r.rid in prompts for r in sched.waiting)
        before = next((len(r.output_ids) for r in sched.running if r.rid == "running"), None)
        for out in sched.step():
            ids.setdefault(out.rid, []).extend(out.new_ids)
        after = next((len(r.output_ids) for r in sched.running if r.rid == "running"), None)
        if waiting and before is not None and after is not None:
            decoded_while_waiting += after - before
    if interleave:
        assert decoded_while_waiting >= 5  # a decode between each two of the six prefill batches
    else:
        assert decoded_while_waiting <= 1  # (overlap may run one decode launched ahead)
    for rid, prompt in prompts.items():  # the order of batches changes no request's tokens
        assert ids[rid] == reference(prompt, 3)


def test_a_policy_match_made_stale_by_eviction_is_not_used(make_scheduler):
    # lpm matches every waiting request up front; admitting the first one evicts the cached prefix the
    # second one matched. Reusing that stale match would read freed KV slots (and give wrong tokens).
    sched = make_scheduler(policy="lpm", runner_kwargs={"max_total_tokens": 200})
    p1, p2 = list(range(100, 160)), list(range(400, 450))
    sched.add_request(request("warm1", p1, 1))
    sched.add_request(request("warm2", p2, 1))
    run_to_completion(sched)
    assert sched.cache.evictable_size() == 110
    b, c = p1 + list(range(600, 700)), p2 + list(range(800, 810))
    sched.add_request(request("b", b, 5))
    sched.add_request(request("c", c, 5))
    results = run_to_completion(sched)
    assert results["b"]["ids"] == reference(b, 5)
    assert results["c"]["ids"] == reference(c, 5)


# ---- overlap scheduling: what runs ahead, and what must wait ------------------------------------
def overlapped_results(events: list[tuple[str, int]]) -> int:
    """How many batches were launched while an earlier batch's result was still unprocessed."""
    done: set[int] = set()
    ahead = 0
    for kind, n in events:
        if kind == "result":
            done.add(n)
        elif any(m not in done for m in range(n)):
            ahead += 1
    return ahead


def toy_scheduler(overlap: bool, **scheduler) -> Scheduler:
    config = Config.build({"scheduler": scheduler, "runtime": {"overlap": overlap}})
    return Scheduler.from_config(config, ToyRunner(vocab_size=VOCAB), Registry.discover())


def test_overlap_launches_each_decode_before_processing_the_previous_one():
    reqs = [(f"r{i}", list(range(10 * i, 10 * i + 12)), 30) for i in range(4)]
    plain, overlap = toy_scheduler(False), toy_scheduler(True)
    out_plain, out_overlap = run_workload(plain, reqs), run_workload(overlap, reqs)
    assert {k: v["ids"] for k, v in out_overlap.items()} == {k: v["ids"] for k, v in out_plain.items()}
    assert overlapped_results(plain.runner.events) == 0
    # one prefill batch, then 29 decode steps: all but the first decode go ahead of their inputs
    decodes = sum(1 for b in overlap.runner.batches if b.future_inputs is not None)
    assert decodes == 28 and overlapped_results(overlap.runner.events) == 28
    # every launched batch is processed exactly once, in launch order
    results = [n for kind, n in overlap.runner.events if kind == "result"]
    assert results == sorted(results) == list(range(len(overlap.runner.batches)))
    assert_nothing_left(plain)
    assert_nothing_left(overlap)


def test_overlap_waits_when_sampling_reads_the_token_history():
    sched = toy_scheduler(True)
    sched.add_request(request("pen", list(range(40, 52)), 12, repetition_penalty=1.2))
    sched.add_request(request("min", list(range(60, 72)), 12, min_new_tokens=6))
    results = run_to_completion(sched)
    assert results["pen"]["ids"] == reference(list(range(40, 52)), 12)
    # "min" reads its history until it has 6 tokens; "pen" always does: nothing runs ahead of it
    assert overlapped_results(sched.runner.events) == 0
    assert_nothing_left(sched)


def test_overlap_drops_the_token_launched_after_an_eos():
    prompt = list(range(50, 70))
    ref = reference(prompt, 20)
    eos = ref[5]
    runner = ToyRunner(vocab_size=VOCAB, eos_token_ids=(eos,))
    sched = Scheduler.from_config(Config.build({"runtime": {"overlap": True}}), runner, Registry.discover())
    sched.add_request(request("eos", prompt, 20))
    results = run_to_completion(sched)
    assert results["eos"]["ids"] == ref[:6] and results["eos"]["finish"] == {"type": "stop", "matched": eos}
    # the step after the EOS was already launched (7 forwards for 6 tokens) and its token dropped
    assert len(runner.batches) == 7
    assert sched.metrics.generated_tokens == 6
    assert_nothing_left(sched)


def test_overlap_keeps_decoding_ahead_while_requests_wait_for_a_running_slot():
    sched = toy_scheduler(True, max_running_requests=2)
    reqs = [(f"r{i}", list(range(7 * i, 7 * i + 9)), 20) for i in range(4)]
    results = run_workload(sched, reqs)
    for rid, prompt, max_new in reqs:
        assert results[rid]["ids"] == reference(prompt, max_new), rid
    # two waves of two requests: each wave's decodes after its first go ahead, though two wait
    assert sched.metrics.overlapped_batches >= 2 * 17
    assert_nothing_left(sched)


@pytest.mark.parametrize("cache,threshold,computed", [("radix", 16, 45 + 5 * 5), ("radix", 0, 6 * 45), ("chunk", 16, 6 * 45)])
def test_requests_sharing_an_uncached_prefix_compute_it_once(make_scheduler, cache, threshold, computed):
    """Six prompts arrive together sharing 40 uncached tokens: the first is admitted, the others wait
    one step and then read those 40 tokens from the radix cache (a non-sharing cache holds no one back)."""
    sched = make_scheduler(cache=cache, in_batch_prefix_threshold=threshold)
    shared = list(range(500, 540))
    reqs = [(f"s{i}", shared + [10 * i + j for j in range(1, 6)], 6) for i in range(6)]
    results = run_workload(sched, reqs)
    for rid, prompt, max_new in reqs:
        assert results[rid]["ids"] == reference(prompt, max_new), rid
    assert sched.metrics.prefill_tokens_computed == computed


def test_a_requests_decode_tokens_sit_in_consecutive_slots(make_scheduler):
    """With memory to spare each request's decode KV comes in runs of DECODE_RUN consecutive
    slots (the CPU attention reads them faster); the unused rest of a run is freed at the end
    (the fixture checks no slot leaked)."""
    from radixserve.scheduler.scheduler import DECODE_RUN

    sched = make_scheduler()
    prompts = {f"r{i}": list(range(10 * i + 1, 10 * i + 6)) for i in range(4)}
    for rid, p in prompts.items():
        sched.add_request(request(rid, p, DECODE_RUN + 4))
    rows: dict[str, list[int]] = {}
    for _ in range(100):
        if not sched.has_work():
            break
        sched.step()
        for req in sched.running:  # the row before it is freed: prompt + decode slots so far
            rows[req.rid] = sched.req_to_token_pool.read(req.req_pool_idx, req.kv_len).tolist()
    for rid, slots in rows.items():
        decode = slots[len(prompts[rid]) :][:DECODE_RUN]
        assert len(decode) >= DECODE_RUN - 1
        assert decode == list(range(decode[0], decode[0] + len(decode))), (rid, decode)


def test_out_of_vocabulary_ids_reaching_the_scheduler_are_rejected(make_scheduler):
    """A backstop behind the API edge: an id outside the vocabulary would raise IndexError in the
    embedding and end the scheduler process; here it is an error output and the rest runs on."""
    sched = make_scheduler()
    sched.add_request(request("big", [5, VOCAB], 3))
    sched.add_request(request("neg", [-5], 3))
    sched.add_request(request("bias", [5], 3, logit_bias={VOCAB + 1: 1.0}))
    sched.add_request(request("stop", [5], 3, stop_token_ids=[-1]))
    sched.add_request(request("ok", [1, 2, 3], 3))
    results = run_to_completion(sched)
    assert results["big"]["outs"][0].error == f"input_ids[1] token id {VOCAB} is out of range [0, {VOCAB})"
    assert "input_ids[0] token id -5 is out of range" in results["neg"]["outs"][0].error
    assert "logit_bias" in results["bias"]["outs"][0].error
    assert "stop_token_ids[0]" in results["stop"]["outs"][0].error
    assert results["ok"]["ids"] == reference([1, 2, 3], 3)
    assert sched.metrics.rejected_requests == 4


# ---- failure isolation (issue 12): one request's failing forward must not take the others down ----


class FailingRunner(ToyRunner):
    """Raises from result() for any batch holding a request that `poisoned(req)` names."""

    def __init__(self, poisoned, **kw) -> None:
        super().__init__(**kw)
        self.poisoned = poisoned
        self.failures = 0

    def launch_batch(self, sb):
        launched = super().launch_batch(sb)
        if not any(self.poisoned(r) for r in sb.reqs):
            return launched

        def fail():
            self.failures += 1
            raise RuntimeError("injected: a kernel rejected this request")

        return type(launched)(launched.token_ids, fail)


def _with_runner(sched, runner):
    """Swap the toy runner for a failing one sharing its pools (the scheduler keeps the pools)."""
    runner.req_to_token_pool = sched.runner.req_to_token_pool
    runner.token_allocator = sched.runner.token_allocator
    runner.kv_pool = sched.runner.kv_pool
    sched.runner = runner
    return runner


def test_a_request_that_always_fails_gets_a_500_and_the_others_are_unharmed(make_scheduler):
    sched = make_scheduler()
    runner = _with_runner(sched, FailingRunner(lambda r: r.rid == "poison" and len(r.output_ids) >= 3, vocab_size=VOCAB))
    reqs = workload(seed=3, n=10)
    for rid, prompt, max_new in reqs:
        sched.add_request(request(rid, prompt, max_new))
    sched.add_request(request("poison", [5, 6, 7, 8], 20))
    results = run_to_completion(sched)

    poison = results["poison"]["outs"][-1]
    assert poison.error is not None and poison.error_status == 500
    assert runner.failures >= 2, "the culprit was not re-run alone before it was failed"
    for rid, prompt, max_new in reqs:
        assert results[rid]["ids"] == reference(prompt, max_new), rid
        assert results[rid]["finish"] == {"type": "length"}
    stats = sched.stats()
    assert stats["failed_requests"] == 1 and stats["finished_requests"] == len(reqs)
    # make_scheduler's teardown asserts no request left behind and free == total after a flush


def test_a_one_off_failure_is_retried_and_every_output_is_unchanged(make_scheduler):
    failed_once: set[str] = set()

    def poisoned(req):
        if req.rid == "flaky" and "flaky" not in failed_once and len(req.output_ids) >= 2:
            failed_once.add("flaky")
            return True
        return False

    sched = make_scheduler()
    _with_runner(sched, FailingRunner(poisoned, vocab_size=VOCAB))
    reqs = workload(seed=4, n=8) + [("flaky", [9, 8, 7, 6, 5], 12)]
    for rid, prompt, max_new in reqs:
        sched.add_request(request(rid, prompt, max_new))
    results = run_to_completion(sched)
    assert failed_once == {"flaky"}
    for rid, prompt, max_new in reqs:
        assert results[rid]["ids"] == reference(prompt, max_new), rid
    assert sched.stats()["failed_requests"] == 0


@pytest.mark.parametrize("chunk", [8])
def test_isolation_with_chunked_prefill(make_scheduler, chunk):
    sched = make_scheduler(chunked_prefill_size=chunk)
    _with_runner(sched, FailingRunner(lambda r: r.rid == "poison", vocab_size=VOCAB))
    reqs = workload(seed=5, n=8)
    for rid, prompt, max_new in reqs:
        sched.add_request(request(rid, prompt, max_new))
    sched.add_request(request("poison", list(range(1, 40)), 5))
    results = run_to_completion(sched)
    assert results["poison"]["outs"][-1].error_status == 500
    for rid, prompt, max_new in reqs:
        assert results[rid]["ids"] == reference(prompt, max_new), rid


def test_stats_split_busy_step_time_into_forward_and_host(make_scheduler):
    """stats() tells where a busy scheduler's time goes (the served-throughput profile reads it):
    every step that ran a batch is counted with its seconds; an idle step is not; without overlap
    the forward's share is measured and is part of the step time."""
    import time

    sched = make_scheduler()
    launch = sched.runner.launch_batch

    def slow_launch(sb):
        time.sleep(0.005)  # a forward that takes measurable time
        return launch(sb)

    sched.runner.launch_batch = slow_launch
    sched.step()  # nothing to do: not a step of work
    assert sched.stats()["steps"] == 0 and sched.stats()["step_seconds"] == 0
    sched.add_request(request("a", list(range(10, 30)), 4))
    run_to_completion(sched)
    stats = sched.stats()
    batches = len(sched.runner.batches)
    assert stats["steps"] >= batches > 0
    assert stats["step_seconds"] >= 0.005 * batches
    if sched.overlap:
        assert stats["forward_seconds"] == 0  # a launched-ahead forward runs under host work
    else:
        assert stats["steps"] == batches
        assert 0.005 * batches <= stats["forward_seconds"] <= stats["step_seconds"]


@pytest.mark.parametrize("overlap", [False, True])
def test_step_trace_records_each_forward_by_kind(tmp_path, monkeypatch, overlap):
    """RADIXSERVE_STEP_TRACE: one line per forward with its decode rows and prefill tokens (what
    benchmarks/step_trace_summary.py splits a run by), with and without overlap; the prompt tokens
    and generated tokens it records add up to the workload's, and the summary reads the file back.
    Under overlap the steps are charged back to back: each starts no earlier than the last one's end."""
    import importlib.util
    from pathlib import Path

    trace = tmp_path / "steps.trace"
    monkeypatch.setenv("RADIXSERVE_STEP_TRACE", str(trace))
    config = Config.build({"scheduler": {"chunked_prefill_size": 16, "enable_mixed_chunk": True},
                           "runtime": {"overlap": overlap}})
    sched = Scheduler.from_config(config, ToyRunner(vocab_size=VOCAB), Registry.discover())
    prompts = {"a": [5] * 30, "b": [7, 8, 9]}
    for rid, prompt in prompts.items():
        sched.add_request(request(rid, prompt, 6))
    out = run_to_completion(sched)
    rows = [line.split() for line in trace.read_text().splitlines()]
    assert rows and all(len(r) == 4 and float(r[3]) >= 0 for r in rows)
    assert sum(int(r[2]) for r in rows) == sum(len(p) for p in prompts.values())  # no prefix hits here
    # each request's first token comes from its last prefill chunk, the rest from decode rows
    assert sum(int(r[1]) for r in rows) == sum(len(o["ids"]) - 1 for o in out.values())
    assert any(int(r[1]) and int(r[2]) for r in rows), "no mixed step was recorded as mixed"
    if overlap:
        assert sched.overlap and sched.metrics.overlapped_batches > 0
        ends = [float(r[0]) + float(r[3]) for r in rows]
        # each field is printed to 1 us, so a start and the sum before it may differ by up to 1.5 us
        assert all(float(b[0]) >= end - 1e-5 for b, end in zip(rows[1:], ends))
    assert_nothing_left(sched)
    spec = importlib.util.spec_from_file_location(
        "step_trace_summary", Path(__file__).resolve().parents[1] / "benchmarks" / "step_trace_summary.py")
    summary = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(summary)
    (run,) = summary.read_runs(str(trace))
    assert len(run) == len(rows) and any("prefill/mixed" in line for line in summary.summarise(run))
    # grouped by rows (--bucket), the decode lines still count every decode-only step once
    decode_only = sum(1 for r in rows if int(r[2]) == 0)
    counted = [int(line.split(":")[1].split()[0]) for line in summary.summarise(run, bucket=4)
               if line.startswith("decode")]
    assert sum(counted) == decode_only and len(counted) <= 2  # at most 1-4 and 5-8 rows here


def test_overlap_keeps_decoding_ahead_while_the_queue_waits_for_memory():
    """Requests that wait because the KV pool is full (not for a running slot) do not stop the
    lookahead: the decodes go ahead until enough memory is free for the next one, which is then
    admitted as without overlap; outputs are those of the plain scheduler."""
    reqs = [(f"r{i}", list(range(40 * i, 40 * i + 40)), 30) for i in range(5)]

    def memory_bound(overlap: bool) -> Scheduler:  # room for two of the five requests at a time
        config = Config.build({"runtime": {"overlap": overlap}})
        return Scheduler.from_config(config, ToyRunner(vocab_size=VOCAB, max_total_tokens=160), Registry.discover())

    plain, sched = memory_bound(False), memory_bound(True)
    ahead_while_waiting = []
    launch = sched.runner.launch_batch

    def recording_launch(sb):
        if sb.future_inputs is not None:
            ahead_while_waiting.append(len(sched.waiting))
        return launch(sb)

    sched.runner.launch_batch = recording_launch
    out_plain, out = run_workload(plain, reqs), run_workload(sched, reqs)
    for rid, prompt, max_new in reqs:
        assert out[rid]["ids"] == out_plain[rid]["ids"] == reference(prompt, max_new), rid
    assert sum(1 for w in ahead_while_waiting if w > 0) >= 10  # went ahead with requests waiting for memory
    assert len(sched.runner.batches) == len(plain.runner.batches)  # admitted at the same steps
    assert sched.metrics.retractions == plain.metrics.retractions == 0
    assert_nothing_left(plain)
    assert_nothing_left(sched)


def test_debug_logging_follows_each_request_and_batch(make_scheduler, caplog):
    """server.log_level=debug: each request's queueing, admission (with its cached prefix), finish or abort, and
    each batch's make-up are logged (was: the level added nothing but a retraction line)."""
    sched = make_scheduler()
    system = list(range(200, 240))
    with caplog.at_level(logging.DEBUG, logger="radixserve.scheduler.scheduler"):
        sched.add_request(request("first", system + [1, 2], 3))
        run_to_completion(sched)
        sched.add_request(request("second", system + [3, 4], 3))
        sched.add_request(request("gone", [5, 6, 7], 40))
        sched.step()
        sched.abort("gone")
        sched.add_request(request("second", [1], 1))  # its id is still in use
        run_to_completion(sched)
    said = [r.getMessage() for r in caplog.records]
    assert "request first queued: 42 prompt tokens, max_new_tokens 3, priority 0; 1 waiting" in said, said
    assert any(m.startswith("request second admitted: 40 of 42 prompt tokens from the prefix cache") for m in said)
    assert "request first finished (length): 3 output tokens, 0 prompt tokens from the cache" in said, said
    assert any(m.startswith("request gone aborted after") for m in said), said
    assert "request second refused: request id 'second' is already in use" in said, said
    assert any(m.startswith("batch: 0 decode rows, 42 prompt tokens of 1 requests") for m in said), said
    assert any(m.startswith("batch: ") and " decode rows," in m and not m.startswith("batch: 0 ") for m in said)
