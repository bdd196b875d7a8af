"""Greedy tokens straight from the LM head (layers/cpu_greedy_head.py, csrc/greedy_head.cpp): the
bf16-screened argmax must be torch.argmax of the fp32 logits, and the runner must take that path
only when nothing else reads the logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from radixserve.config import Config
from radixserve.layers import cpu_greedy_head
from radixserve.model_runner import ModelRunner
from radixserve.state import ForwardMode, Req, SamplingParams
from runner_driver import _batch


def _cpu_flags() -> set[str]:
    with open("/proc/cpuinfo") as f:
        return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())


HAS_AVX512 = "avx512f" in _cpu_flags()
HAS_BF16 = HAS_AVX512 and "avx512_bf16" in _cpu_flags()


def test_screen_is_built_exactly_where_the_cpu_has_avx512():
    head = cpu_greedy_head.pack(torch.randn(50, 8))
    assert (head is not None) == HAS_AVX512, "AVX-512 CPU: the kernel must build (see the log)"
    if head is not None and not HAS_BF16:  # no vdpbf16ps here: the screen widens the weights
        assert head.widen
    assert cpu_greedy_head.pack(torch.randn(50, 8, dtype=torch.bfloat16)) is None
    bad = torch.randn(50, 8)
    bad[3, 1] = float("inf")
    assert cpu_greedy_head.pack(bad) is None  # the bound needs finite weights


needs_avx512 = pytest.mark.skipif(not HAS_AVX512, reason="this CPU has no AVX-512: the screen is off here")


def _needs_product(widen: bool) -> None:
    if not widen and not HAS_BF16:
        pytest.skip("this CPU has no AVX-512 BF16: the screen only ever widens the weights here")


@needs_avx512
@pytest.mark.parametrize("widen", [False, True])
@pytest.mark.parametrize(("vocab", "hidden", "rows"), [(50, 7, 3), (1000, 33, 9), (97, 576, 1), (4801, 576, 64)])
def test_screened_argmax_is_the_fp32_argmax(vocab, hidden, rows, widen):
    """Partial 48-row panels, odd hidden sizes (a half bf16 pair), every row remainder of the
    8-row microkernel; the screen by vdpbf16ps and by widened weights (cpu_gemm.bf16_products_widened)."""
    _needs_product(widen)
    gen = torch.Generator().manual_seed(vocab)
    w, x = torch.randn(vocab, hidden, generator=gen), torch.randn(rows, hidden, generator=gen)
    head = cpu_greedy_head.pack(w, widen=widen)
    assert head.widen == widen
    assert torch.equal(cpu_greedy_head.argmax(x, w, head), F.linear(x, w).argmax(-1))


@needs_avx512
@pytest.mark.parametrize("widen", [False, True])
def test_near_ties_exact_ties_and_non_finite_rows(widen):
    _needs_product(widen)
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(300, 64, generator=gen)
    w[200] = w[17]  # an exact tie: the first index wins
    w[101] = w[100] * (1 + 2**-20)  # closer than bf16 can tell apart: fp32 decides
    x = torch.randn(6, 64, generator=gen)
    x[0] = w[17] * 3
    x[1] = w[100] * 3
    x[2, 5] = float("nan")
    x[3, 9] = float("inf")
    x[4] = 0.0  # every logit 0: index 0
    head = cpu_greedy_head.pack(w, widen=widen)
    got = cpu_greedy_head.argmax(x, w, head)
    assert torch.equal(got, torch.argmax(F.linear(x, w), dim=-1))
    assert got[0] == 17 and got[4] == 0


@needs_avx512
def test_a_build_without_vdpbf16ps_screens_widened_whatever_the_gemm_chose(monkeypatch):
    """The screen's own build decides where it has no vdpbf16ps: a process whose native GEMM did not build
    (bf16_products_widened() False) must not ask it for the product it lacks (a RuntimeError at every greedy step)."""
    if HAS_BF16:
        pytest.skip("this CPU has AVX-512 BF16: both screens run here")
    from radixserve.layers import cpu_gemm

    monkeypatch.setattr(cpu_gemm, "bf16_products_widened", lambda: False)
    gen = torch.Generator().manual_seed(3)
    w, x = torch.randn(500, 64, generator=gen), torch.randn(5, 64, generator=gen)
    head = cpu_greedy_head.pack(w)
    assert head.widen
    assert torch.equal(cpu_greedy_head.argmax(x, w, head), F.linear(x, w).argmax(-1))


@pytest.mark.parametrize("want_logprobs", [False, True])
def test_runner_takes_greedy_ids_only_when_nothing_else_reads_the_logits(tiny_llama_dir, want_logprobs):
    path = tiny_llama_dir("llama", vocab_size=1000)
    cfg = Config.build({"model": {"path": path}, "runtime": {"device": "cpu", "dtype": "float32", "num_threads": 1},
                        "scheduler": {"max_total_tokens": 512, "max_running_requests": 4}})
    runner = ModelRunner(cfg, show_progress=False)
    assert (runner.model.lm_head.greedy_head is not None) == HAS_AVX512
    calls = []
    original = runner.model.greedy_token_ids
    runner.model.greedy_token_ids = lambda hidden, vocab: calls.append(hidden.shape[0]) or original(hidden, vocab)
    prompts = [[5, 9, 2, 7], [3, 3, 8, 1, 4, 4]]
    sp = SamplingParams(temperature=0.0, logprobs=want_logprobs)
    reqs = [Req(rid=str(i), origin_input_ids=p, sampling_params=sp) for i, p in enumerate(prompts)]
    rows = [runner.req_to_token_pool.alloc() for _ in prompts]
    slots = runner.token_allocator.alloc(sum(map(len, prompts)))
    offset = 0
    for row, p in zip(rows, prompts, strict=True):
        runner.req_to_token_pool.write(row, 0, slots[offset : offset + len(p)])
        offset += len(p)
    sb = _batch(ForwardMode.EXTEND, reqs, [t for p in prompts for t in p], rows, [0, 0], list(map(len, prompts)), slots)
    want = runner.forward_logits(sb).argmax(-1).tolist()
    result = runner.run_batch(sb)
    assert result.next_token_ids == want
    assert calls == ([] if want_logprobs else [len(prompts)])
    assert (result.token_logprobs is not None) == want_logprobs
