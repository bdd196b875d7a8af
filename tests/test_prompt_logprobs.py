"""Prompt logprobs (SamplingParams.prompt_logprobs; OpenAI completions' `echo` with `logprobs`, as
lm-evaluation-harness scores a continuation; /generate's `logprob_start_len`).

The scheduler's bookkeeping runs on the toy runner (each scored row reads its history through its KV
slots, so a wrong row, target or slot changes the value): chunked prefill, overlap scheduling, a warm
prefix cache, retraction. The values themselves are checked against transformers on a tiny
checkpoint, and the HTTP shapes against the served SmolLM2 with the official client."""

from __future__ import annotations

import random

import pytest
import torch
from radixserve.config import Config
from radixserve.plugins.registry import Registry
from radixserve.runtime.messages import GenerateRequest
from radixserve.scheduler import Scheduler
from radixserve.state import SamplingParams
from radixserve.testing import ToyRunner, toy_next_token, toy_prompt_logprobs, toy_prompt_ranks, toy_reference

VOCAB = 1000


def _scheduler(overlap: bool, cache: str = "radix", runner_kwargs=None, **scheduler) -> Scheduler:
    config = Config.build({"stack": {"prefix_cache": cache}, "scheduler": scheduler, "runtime": {"overlap": overlap}})
    return Scheduler.from_config(config, ToyRunner(vocab_size=VOCAB, **(runner_kwargs or {})), Registry.discover())


def _request(rid: str, prompt: list[int], max_new: int, prompt_logprobs: int | None) -> GenerateRequest:
    sp = SamplingParams(max_new_tokens=max_new, temperature=0, prompt_logprobs=prompt_logprobs)
    return GenerateRequest(rid=rid, input_ids=prompt, sampling_params=sp)


def _run(sched: Scheduler, requests: list[GenerateRequest]) -> dict[str, list]:
    """Every emission of every request, in order, until the scheduler is idle (and nothing leaked)."""
    for r in requests:
        sched.add_request(r)
    outs: dict[str, list] = {}
    for _ in range(100_000):
        if not sched.has_work():
            break
        for out in sched.step():
            outs.setdefault(out.rid, []).append(out)
    assert not sched.has_work(), "the scheduler did not go idle"
    assert sched.flush_cache() and sched.allocator.available_size() == sched.allocator.size, "KV slots leaked"
    return outs


def _check(outs: dict[str, list], rid: str, prompt: list[int], max_new: int, top: int | None) -> None:
    emissions = outs[rid]
    assert [t for o in emissions for t in o.new_ids] == toy_reference(prompt, max_new, VOCAB), rid
    if top is None:
        assert all(o.prompt_token_logprobs is None for o in emissions), f"{rid} did not ask for prompt logprobs"
        return
    first, *rest = emissions
    assert all(o.prompt_token_logprobs is None for o in rest), f"{rid}: prompt logprobs are sent once, first"
    assert first.prompt_token_logprobs == toy_prompt_logprobs(prompt, VOCAB), rid
    assert first.prompt_token_ranks == toy_prompt_ranks(prompt, VOCAB), rid
    if top:
        expected = [[(toy_next_token(prompt[: i + 1], VOCAB), 0.0)] for i in range(len(prompt) - 1)]
        assert first.prompt_top_logprobs == expected, rid
    else:
        assert first.prompt_top_logprobs is None, rid
    assert first.cached_tokens == 0, f"{rid}: a scored prompt is computed, not taken from the cache"


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("chunk", [None, 7], ids=["whole", "chunked"])
@pytest.mark.parametrize("cache", ["radix", "chunk"])
def test_prompt_logprobs_follow_the_prompt_through_chunks_a_warm_cache_and_overlap(overlap, chunk, cache):
    rng = random.Random(3)
    shared = [rng.randrange(VOCAB) for _ in range(30)]
    work = []
    for i in range(10):
        prompt = (shared if i % 2 else []) + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 40))]
        work.append((f"r{i}", prompt, rng.randint(0, 6), [None, 0, 2][i % 3]))
    sched = _scheduler(overlap, cache, chunked_prefill_size=chunk)
    # the same prompts twice: the second round finds them in the cache, and scoring must not use it
    for round_ in range(2):
        outs = _run(sched, [_request(f"{rid}.{round_}", p, n, top) for rid, p, n, top in work])
        for rid, prompt, max_new, top in work:
            _check(outs, f"{rid}.{round_}", prompt, max_new, top)
    unscored_hits = sum(o.cached_tokens for rid, *_ in work[::3] for o in outs[f"{rid}.1"][:1])
    assert cache == "chunk" or unscored_hits > 0, "the unscored repeats were meant to hit the cache"


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_prompt_logprobs_survive_retraction(overlap):
    rng = random.Random(5)
    work = [(f"r{i}", [rng.randrange(VOCAB) for _ in range(rng.randint(20, 90))], rng.randint(10, 40), i % 2)
            for i in range(16)]
    sched = _scheduler(overlap, chunked_prefill_size=16, schedule_conservativeness=0.05,
                       runner_kwargs={"max_total_tokens": 260})
    outs = _run(sched, [_request(rid, p, n, top) for rid, p, n, top in work])
    assert sched.metrics.retractions > 0, "the pool was meant to force retraction"
    for rid, prompt, max_new, top in work:
        _check(outs, rid, prompt, max_new, top)


def test_a_one_token_prompt_and_no_output_tokens():
    sched = _scheduler(False)
    outs = _run(sched, [_request("one", [5], 3, 1), _request("none", [5, 6, 7], 0, 1)])
    assert outs["one"][0].prompt_token_logprobs == [] and outs["one"][0].prompt_top_logprobs == []
    (only,) = outs["none"]  # max_new_tokens 0: one emission, the prompt's logprobs and no token
    assert only.new_ids == [] and only.finished_reason == {"type": "length"}
    assert only.prompt_token_logprobs == toy_prompt_logprobs([5, 6, 7], VOCAB)


def test_prompt_logprobs_out_of_range_are_refused():
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21).validate()
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1).validate()


# ---- the values: a real model against transformers ----------------------------------------------


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_prompt_logprobs_match_transformers_chunked_or_not(tiny_llama_dir, overlap):
    from radixserve.model_runner import ModelRunner
    from transformers import AutoModelForCausalLM

    path = tiny_llama_dir("llama")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    rng = random.Random(11)
    vocab = hf.config.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in (1, 9, 40, 77)]
    results = {}
    for chunk in (None, 16):
        cfg = Config.build({
            "model": {"path": path},
            "runtime": {"device": "cpu", "dtype": "float32", "num_threads": 1, "overlap": overlap},
            "scheduler": {"max_total_tokens": 2048, "max_running_requests": 8, "chunked_prefill_size": chunk},
        })
        sched = Scheduler.from_config(cfg, ModelRunner(cfg, show_progress=False), Registry.discover())
        requests = [_request(f"p{i}", p, 3, 3) for i, p in enumerate(prompts)]
        requests.append(_request("plain", prompts[2], 3, None))  # batched beside the scored ones
        outs = _run(sched, requests)
        results[chunk] = outs
        for i, prompt in enumerate(prompts):
            first = outs[f"p{i}"][0]
            with torch.no_grad():
                ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
            expected = ref[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:], dtype=torch.long)]
            assert torch.allclose(torch.tensor(first.prompt_token_logprobs), expected, atol=1e-4), (chunk, i)
            # ranks as vLLM counts them: the vocabulary entries at least as likely (itself included), up to
            # entries within the logprobs' tolerance of the token's
            surely_above = (ref[:-1] >= expected[:, None] + 1e-4).sum(1)
            maybe_above = (ref[:-1] >= expected[:, None] - 1e-4).sum(1)
            ranks = torch.tensor(first.prompt_token_ranks)
            assert bool(((surely_above <= ranks) & (ranks <= maybe_above)).all()), (chunk, i)
            for pos, alts in enumerate(first.prompt_top_logprobs):
                values, ids = ref[pos].topk(3)
                assert [t for t, _ in alts] == ids.tolist(), (chunk, i, pos)
                assert torch.allclose(torch.tensor([lp for _, lp in alts]), values, atol=1e-4)
        generated = {rid: [t for o in emissions for t in o.new_ids] for rid, emissions in outs.items()}
        assert generated["plain"] == generated["p2"], "scoring a prompt changed what is generated"
    for i in range(len(prompts)):
        assert torch.allclose(torch.tensor(results[None][f"p{i}"][0].prompt_token_logprobs),
                              torch.tensor(results[16][f"p{i}"][0].prompt_token_logprobs), atol=1e-5)


# ---- HTTP: the served SmolLM2 ---------------------------------------------------------------------


@pytest.mark.slow
def test_completions_echo_with_logprobs_scores_the_prompt(shared_smollm2_server):
    """lm-evaluation-harness's loglikelihood request (`echo`, `logprobs: 1`, `max_tokens: 1`) and the
    prompt alone (`max_tokens: 0`), with the official client; /generate's logprob_start_len."""
    import httpx
    import openai

    srv = shared_smollm2_server
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0)
    context = "The capital of France is"
    whole = client.completions.create(model=srv.model, prompt=context + " Paris", max_tokens=1, temperature=0,
                                      logprobs=1, echo=True)
    lp = whole.choices[0].logprobs
    prompt_ids = httpx.post(f"{srv.url}/generate", timeout=60, json={
        "text": context + " Paris", "sampling_params": {"max_new_tokens": 0}, "return_logprob": True,
        "logprob_start_len": 0}).json()["meta_info"]["input_token_logprobs"]
    n = len(prompt_ids)
    assert len(lp.tokens) == n + 1 and whole.choices[0].text.startswith(context + " Paris")
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing precedes the first token
    assert all(isinstance(x, float) and x <= 0 for x in lp.token_logprobs[1:])
    assert lp.tokens[-2] == " Paris" and lp.text_offset[:2] == [0, len(lp.tokens[0])]
    for got, (expected, _) in zip(lp.token_logprobs[1:n], prompt_ids[1:], strict=True):
        assert got == pytest.approx(expected, abs=1e-4)
    # the greedy check lm-eval makes: a token that is the model's argmax has the top logprob
    for got, top in zip(lp.token_logprobs[1:], lp.top_logprobs[1:], strict=True):
        assert got <= max(top.values()) + 1e-6
    # scoring agrees with generating: " Paris"'s logprob after the context, as an output token
    gen = client.completions.create(model=srv.model, prompt=context, max_tokens=1, temperature=0, logprobs=1)
    if gen.choices[0].logprobs.tokens[0] == " Paris":
        assert gen.choices[0].logprobs.token_logprobs[0] == pytest.approx(lp.token_logprobs[n - 1], abs=1e-3)
    # max_tokens 0 with echo: the prompt's logprobs alone
    alone = client.completions.create(model=srv.model, prompt=[[504, 3575, 282], [1, 2]], max_tokens=0, logprobs=0,
                                      echo=True)
    assert [c.logprobs.token_logprobs[0] for c in alone.choices] == [None, None]
    assert [len(c.logprobs.tokens) for c in alone.choices] == [3, 2] and alone.usage.completion_tokens == 0
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=srv.model, prompt="x", max_tokens=0)
    # streamed: the echoed prompt's entries come with the first chunk
    chunks = list(client.completions.create(model=srv.model, prompt=context, max_tokens=2, temperature=0, logprobs=0,
                                            echo=True, stream=True))
    assert chunks[0].choices[0].text.startswith(context)
    assert chunks[0].choices[0].logprobs.token_logprobs[0] is None
    assert sum(len(c.choices[0].logprobs.tokens) for c in chunks if c.choices) == len(prompt_ids) - 1 + 2
    # /generate: from logprob_start_len on
    part = httpx.post(f"{srv.url}/generate", timeout=60, json={
        "text": context + " Paris", "sampling_params": {"max_new_tokens": 1}, "return_logprob": True,
        "logprob_start_len": 2, "top_logprobs_num": 2}).json()["meta_info"]
    assert [t for _, t in part["input_token_logprobs"]] == [t for _, t in prompt_ids[2:]]
    assert len(part["input_top_logprobs"]) == n - 2 and all(len(a) == 2 for a in part["input_top_logprobs"])
    refused = httpx.post(f"{srv.url}/generate", timeout=60, json={"text": "x", "logprob_start_len": 0})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "logprob_start_len"


@pytest.mark.slow
def test_vllm_prompt_logprobs_field(shared_smollm2_server):
    """vLLM's `prompt_logprobs` extension: per prompt token of a completion choice (and at the top level of
    a chat response) None for the first, else the token's {logprob, rank, decoded_token} and its
    alternatives', keyed by token id; the same logprobs as `echo`; refused with stream or out of range."""
    import httpx

    srv = shared_smollm2_server
    prompt = "The capital of France is Paris"
    body = {"model": srv.model, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    got = httpx.post(f"{srv.url}/v1/completions", timeout=60, json={**body, "prompt_logprobs": 2}).json()
    echo = httpx.post(f"{srv.url}/v1/completions", timeout=60, json={**body, "echo": True, "logprobs": 2}).json()
    entries, echoed = got["choices"][0]["prompt_logprobs"], echo["choices"][0]["logprobs"]
    ids = httpx.post(f"{srv.url}/tokenize", timeout=60, json={"model": srv.model, "prompt": prompt}).json()["tokens"]
    assert len(entries) == len(ids) == got["usage"]["prompt_tokens"] and entries[0] is None
    assert "prompt_logprobs" not in echo["choices"][0], "only a request that asks gets the field"
    for j, (tid, entry) in enumerate(zip(ids[1:], entries[1:], strict=True), 1):
        own = entry[str(tid)]
        assert own["logprob"] == pytest.approx(echoed["token_logprobs"][j], abs=1e-5)
        assert own["decoded_token"] == echoed["tokens"][j] and own["rank"] >= 1
        others = {k: v for k, v in entry.items() if k != str(tid)}
        assert len(others) == (2 if own["rank"] > 2 else 1), entry  # the 2 alternatives, one of them maybe itself
        for v in others.values():  # ranked by likelihood against the token itself
            assert v["rank"] in (1, 2)
            if v["rank"] < own["rank"]:
                assert v["logprob"] >= own["logprob"] - 1e-6
            else:
                assert v["logprob"] <= own["logprob"] + 1e-6
        assert (own["rank"] == 1) == (max(echoed["top_logprobs"][j].values()) <= own["logprob"] + 1e-6)
    only = httpx.post(f"{srv.url}/v1/completions", timeout=60, json={**body, "prompt_logprobs": 0}).json()
    assert all(len(e) == 1 for e in only["choices"][0]["prompt_logprobs"][1:])
    chat = httpx.post(f"{srv.url}/v1/chat/completions", timeout=60, json={
        "model": srv.model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "prompt_logprobs": 1}).json()
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
    for bad in ({"prompt_logprobs": 1, "stream": True}, {"prompt_logprobs": 21}, {"prompt_logprobs": -1}):
        r = httpx.post(f"{srv.url}/v1/completions", timeout=60, json={**body, **bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs", (bad, r.text)


def test_prompt_logprobs_through_the_transformers_fallback(tiny_llama_dir):
    """The fallback (model.impl: transformers) hands the runner every row's hidden state as a native
    plugin does, so prompt rows are scored the same way (chunked here)."""
    from radixserve.model_runner import ModelRunner
    from transformers import AutoModelForCausalLM

    path = tiny_llama_dir("qwen3")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    prompt = [random.Random(2).randrange(hf.config.vocab_size) for _ in range(50)]
    cfg = Config.build({"model": {"path": path, "impl": "transformers"},
                        "runtime": {"device": "cpu", "dtype": "float32", "num_threads": 1},
                        "scheduler": {"max_total_tokens": 2048, "chunked_prefill_size": 16}})
    sched = Scheduler.from_config(cfg, ModelRunner(cfg, show_progress=False), Registry.discover())
    first = _run(sched, [_request("a", prompt, 2, 0)])["a"][0]
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
    expected = ref[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:], dtype=torch.long)]
    assert torch.allclose(torch.tensor(first.prompt_token_logprobs), expected, atol=1e-4)
