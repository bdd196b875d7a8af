"""Sampler behaviour per request: greedy, temperature/top-k/top-p/min-p distributions, penalties,
logit bias, min_new_tokens, seeds and logprobs."""

from __future__ import annotations

import math

import pytest
import torch
from radixserve.sampling import Sampler, SamplingBatch
from radixserve.state import Req, SamplingParams

V = 8


def req(prompt=(1, 2, 3), output=(), eos=(), **params) -> Req:
    r = Req(
        rid="r", origin_input_ids=list(prompt), sampling_params=SamplingParams(**params), eos_token_ids=frozenset(eos)
    )
    r.output_ids = list(output)
    return r


def sample(reqs: list[Req], logits: torch.Tensor, sampler: Sampler | None = None):
    sb = SamplingBatch.from_reqs(reqs, logits.shape[-1], "cpu")
    return (sampler or Sampler()).sample(logits, sb)


def frequencies(params: dict, logits_row: torch.Tensor, n: int = 20000) -> torch.Tensor:
    reqs = [req(**params) for _ in range(n)]
    out = sample(reqs, logits_row.expand(n, -1).clone(), Sampler(seed=1234))
    return torch.bincount(out.next_token_ids, minlength=logits_row.numel()).double() / n


def assert_distribution(freq: torch.Tensor, expected: torch.Tensor, n: int = 20000) -> None:
    """Every token's empirical frequency within 5 standard errors of its expected probability
    (and tokens of probability zero never drawn)."""
    expected = expected.double()
    for tok, (f, p) in enumerate(zip(freq.tolist(), expected.tolist(), strict=True)):
        if p == 0.0:
            assert f == 0.0, f"token {tok} has probability 0 but was drawn ({f})"
        else:
            tol = 5 * math.sqrt(p * (1 - p) / n)
            assert abs(f - p) < tol, f"token {tok}: frequency {f:.4f}, expected {p:.4f} +- {tol:.4f}"


PROBS = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.015, 0.005])
LOGITS = PROBS.log()


def test_all_greedy_batch_is_argmax():
    logits = torch.randn(5, 50)
    out = sample([req(temperature=0.0) for _ in range(5)], logits)
    assert torch.equal(out.next_token_ids, logits.argmax(-1))
    assert out.token_logprobs is None and out.top_logprobs is None


def test_top_k_one_equals_greedy_and_greedy_rows_in_mixed_batch():
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    reqs = [req(temperature=1.5, top_k=1), req(temperature=0.0), req(temperature=1.0)] * 2
    for _ in range(20):
        ids = sample(reqs, logits).next_token_ids
        greedy_rows = [0, 1, 3, 4]
        assert torch.equal(ids[greedy_rows], logits.argmax(-1)[greedy_rows])


def test_temperature_one_samples_softmax():
    assert_distribution(frequencies({"temperature": 1.0}, LOGITS), PROBS)


def test_temperature_scales_distribution():
    t = 0.5
    assert_distribution(frequencies({"temperature": t}, LOGITS), torch.softmax(LOGITS / t, -1))
    t = 2.0
    assert_distribution(frequencies({"temperature": t}, LOGITS), torch.softmax(LOGITS / t, -1))


def test_top_p_keeps_smallest_prefix_reaching_p():
    # mass before tokens: 0, .4, .65, .8 -> top_p=0.7 keeps tokens 0, 1, 2
    expected = torch.zeros(V)
    expected[:3] = PROBS[:3] / PROBS[:3].sum()
    assert_distribution(frequencies({"top_p": 0.7}, LOGITS), expected)


def test_top_p_zero_keeps_only_the_most_likely_token():
    # OpenAI accepts top_p 0: greedy filtering (top-p alone would keep no token at all); the argmax is
    # not token 0 here, where an all-zero row would land
    logits = LOGITS.flip(0)
    for params in ({"top_p": 0.0}, {"top_p": 0.0, "temperature": 1.5, "top_k": 4}):
        assert frequencies(params, logits, n=2000)[V - 1] == 1.0, params


def test_top_k_keeps_k_best():
    expected = torch.zeros(V)
    expected[:2] = PROBS[:2] / PROBS[:2].sum()
    assert_distribution(frequencies({"top_k": 2}, LOGITS), expected)


@pytest.mark.parametrize("disabled", [0, -1])
def test_top_k_zero_and_minus_one_both_disable_it(disabled):
    """vLLM's clients send top_k 0 for "off" (its default); it was refused (migration audit 31)."""
    from radixserve.state import SamplingParams

    SamplingParams(top_k=disabled).validate()
    assert_distribution(frequencies({"top_k": disabled}, LOGITS), PROBS)
    with pytest.raises(ValueError, match="top_k must be >= 1, or 0 or -1"):
        SamplingParams(top_k=-2).validate()


def test_min_p_drops_tokens_below_fraction_of_top():
    # min_p=0.2 -> threshold 0.08: keeps tokens 0..3
    expected = torch.zeros(V)
    expected[:4] = PROBS[:4] / PROBS[:4].sum()
    assert_distribution(frequencies({"min_p": 0.2}, LOGITS), expected)


def test_top_p_applies_after_top_k_renormalisation():
    # top_k=3 renormalises to (.5, .3125, .1875); mass before token 2 is .8125 >= .8, so top_p=.8 keeps 2 tokens
    expected = torch.zeros(V)
    expected[:2] = PROBS[:2] / PROBS[:2].sum()
    assert_distribution(frequencies({"top_k": 3, "top_p": 0.8}, LOGITS), expected)


def test_parameters_are_per_request_in_one_batch():
    n = 20000
    reqs = [req(top_k=2) if i % 2 == 0 else req(temperature=1.0) for i in range(2 * n)]
    ids = sample(reqs, LOGITS.expand(2 * n, -1).clone(), Sampler(seed=7)).next_token_ids
    top2 = torch.bincount(ids[0::2], minlength=V).double() / n
    full = torch.bincount(ids[1::2], minlength=V).double() / n
    expected = torch.zeros(V)
    expected[:2] = PROBS[:2] / PROBS[:2].sum()
    assert_distribution(top2, expected, n)
    assert_distribution(full, PROBS, n)


def _run_steps(batch_reqs: list[Req], target: int, logits_fn, steps: int) -> list[int]:
    """Decode `steps` tokens for all requests; return the tokens of batch_reqs[target]."""
    sampler = Sampler()  # unseeded rows use torch's global stream: must not affect seeded rows
    for step in range(steps):
        logits = torch.stack([logits_fn(step, r) for r in batch_reqs])
        ids = sampler.sample(logits, SamplingBatch.from_reqs(batch_reqs, logits.shape[-1], "cpu")).next_token_ids
        for r, t in zip(batch_reqs, ids.tolist(), strict=True):
            r.output_ids.append(t)
    return batch_reqs[target].output_ids


def _flat_logits(step: int, r: Req) -> torch.Tensor:
    return torch.zeros(1000)  # uniform: every draw is pure randomness


def test_seeded_request_reproducible_alone_and_batched():
    alone = _run_steps([req(seed=42, temperature=1.0)], 0, _flat_logits, 12)
    torch.manual_seed(999)
    batch = [req(temperature=1.0), req(seed=7, temperature=0.8), req(seed=42, temperature=1.0), req(temperature=0.0)]
    batched = _run_steps(batch, 2, _flat_logits, 12)
    assert alone == batched
    other_seed = _run_steps([req(seed=43, temperature=1.0)], 0, _flat_logits, 12)
    assert other_seed != alone
    assert len(set(alone)) > 1  # successive steps draw different numbers


def test_repetition_penalty_hf_semantics_over_prompt_and_output():
    logits = torch.tensor([[2.0, 2.0, -1.0, -1.0, 0.5, 0.0, 0.0, 0.0]])
    r = req(prompt=[0], output=[2], repetition_penalty=2.0, temperature=0.0, logprobs=True)
    out = sample([r], logits)
    expected = torch.tensor([1.0, 2.0, -2.0, -1.0, 0.5, 0.0, 0.0, 0.0])
    assert out.next_token_ids.item() == 1  # token 0 was penalised below token 1
    assert torch.allclose(out.token_logprobs, torch.log_softmax(expected, -1)[1:2])


def test_frequency_and_presence_penalties_openai_semantics_over_output_only():
    logits = torch.zeros(1, V)
    r = req(prompt=[5, 5, 5], output=[1, 1, 3], frequency_penalty=0.5, presence_penalty=0.25, top_logprobs=V)
    out = sample([r], logits)
    expected = torch.zeros(V)
    expected[1] = -(2 * 0.5 + 0.25)
    expected[3] = -(1 * 0.5 + 0.25)  # token 5 only in the prompt: untouched
    got = dict(out.top_logprobs[0])
    want = torch.log_softmax(expected, -1)
    for tok in range(V):
        assert got[tok] == pytest.approx(want[tok].item(), abs=1e-5)


def test_negative_presence_penalty_favours_seen_tokens():
    logits = torch.zeros(1, V)
    r = req(output=[6], presence_penalty=-1.0, temperature=0.0)
    assert sample([r], logits).next_token_ids.item() == 6


def test_logit_bias_forces_token():
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    reqs = [
        req(temperature=1.0, logit_bias={17: 100.0}),
        req(temperature=0.0, logit_bias={3: 100.0}),
        req(temperature=0.0),
    ]
    for _ in range(50):
        ids = sample(reqs, logits).next_token_ids.tolist()
        assert ids[:2] == [17, 3]
        assert ids[2] == logits[2].argmax().item()  # bias of another row does not leak


def test_min_new_tokens_suppresses_eos_and_stop_tokens():
    logits = torch.zeros(1, V)
    logits[0, 7] = 50.0  # EOS dominant
    logits[0, 6] = 40.0  # a stop token next
    logits[0, 2] = 1.0
    eos = {7}
    early = req(output=[2, 2], eos=eos, min_new_tokens=3, stop_token_ids=[6], temperature=0.0)
    assert sample([early], logits).next_token_ids.item() == 2
    done = req(output=[2, 2, 2], eos=eos, min_new_tokens=3, stop_token_ids=[6], temperature=0.0)
    assert sample([done], logits).next_token_ids.item() == 7
    # sampling path too: EOS holds ~all mass, yet is never drawn before min_new_tokens
    for _ in range(20):
        r = req(output=[], eos=eos, min_new_tokens=1, temperature=1.0)
        assert sample([r], logits).next_token_ids.item() != 7


def test_ignore_eos_does_not_suppress_eos_as_a_stop():
    logits = torch.zeros(1, V)
    logits[0, 7] = 50.0
    r = req(output=[], eos={7}, min_new_tokens=2, ignore_eos=True, temperature=0.0)
    assert sample([r], logits).next_token_ids.item() == 7


def test_logprobs_are_pre_temperature_and_top_alternatives_sorted():
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    reqs = [
        req(temperature=0.3, logprobs=True, top_logprobs=5),
        req(temperature=0.0),
        req(temperature=2.0, logprobs=True),
    ]
    out = sample(reqs, logits)
    ref = torch.log_softmax(logits, -1)
    ids = out.next_token_ids
    assert torch.allclose(out.token_logprobs[[0, 2]], ref[[0, 2], ids[[0, 2]]])
    top = out.top_logprobs
    assert len(top[0]) == 5 and top[1] == [] and top[2] == []
    want_vals, want_ids = ref[0].topk(5)
    assert [t for t, _ in top[0]] == want_ids.tolist()
    assert [v for _, v in top[0]] == pytest.approx(want_vals.tolist(), abs=1e-6)


def test_padded_vocab_columns_are_never_sampled():
    logits = torch.zeros(2, 12)
    logits[:, 10:] = 100.0  # padding columns beyond the real vocabulary
    sb = SamplingBatch.from_reqs([req(temperature=0.0), req(temperature=1.0)], 10, "cpu")
    for _ in range(20):
        assert (Sampler().sample(logits, sb).next_token_ids < 10).all()


def test_draws_at_vocabulary_width_follow_softmax_and_odd_rows_fall_back():
    # SmolLM2's vocabulary width (49152), the mass on 8 tokens spread over it, the rest -inf or far
    # below: on CPU this is the fused draw (sampling/cpu_draw.py), whose noise is a hash of the
    # column index; a NaN or all -inf row gets the torch path's answer, never an id out of range
    width, n = 49152, 3000
    row = torch.full((width,), float("-inf"))
    row[1::2] = -40.0
    cols = torch.tensor([3, 4100, 9001, 17000, 25002, 33333, 41000, 49151])
    row[cols] = LOGITS
    ids = sample([req(temperature=1.0) for _ in range(n)], row.expand(n, -1), Sampler(seed=5)).next_token_ids
    assert torch.isin(ids, cols).all()
    freq = torch.stack([(ids == c).double().mean() for c in cols])
    assert_distribution(freq, PROBS, n)
    odd = torch.zeros(3, width)
    odd[0, 7] = float("nan")
    odd[1] = float("-inf")
    odd[2, 11] = 50.0
    out = sample([req(temperature=1.0)] * 3, odd, Sampler(seed=5)).next_token_ids
    assert all(0 <= t < width for t in out.tolist()) and out.tolist()[2] == 11


@pytest.mark.parametrize("field", ["temperature", "repetition_penalty", "top_p", "min_p"])
def test_non_finite_sampling_values_are_refused_by_name(field):
    # `radixserve generate --temperature nan` was accepted (the HTTP routes and the Engine refused it)
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match=field):
            SamplingParams(**{field: bad}).validate()
