"""`radixserve bench one-batch` on a tiny checkpoint (CPU)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.fixture(scope="module")
def tiny_path(tiny_llama_dir):
    return tiny_llama_dir("llama")


def test_bench_one_batch_cli_writes_results(tiny_path, tmp_path):
    out = tmp_path / "rows.jsonl"
    cmd = [sys.executable, "-m", "radixserve.cli", "bench", "one-batch", "--model", tiny_path, "--device", "cpu",
           "--batch-size", "1", "2", "--input-len", "8", "--output-len", "4", "--result-file", str(out),
           "runtime.num_threads=1"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [row["batch_size"] for row in rows] == [1, 2]
    assert all(row["decode_tok_s"] > 0 and row["prefill_s"] > 0 for row in rows)
    assert "decode" in r.stdout


@pytest.mark.parametrize("accept_len,output_len,expected", [(None, 21, 5.0), (2, 19, 3.0)])
def test_bench_one_batch_speculative_reports_acceptance(tiny_path, tmp_path, accept_len, output_len, expected):
    # the oracle learns the greedy outputs in the untimed first pass, so the timed pass accepts all
    # 4 drafts per verify (5 tokens a step), or exactly `accept_len` of them (the first token comes
    # from the prefill; output_len - 1 is a multiple of the tokens per verify)
    out = tmp_path / "rows.jsonl"
    cmd = [sys.executable, "-m", "radixserve.cli", "bench", "one-batch", "--model", tiny_path, "--device", "cpu",
           "--batch-size", "2", "--input-len", "8", "--output-len", str(output_len), "--result-file", str(out),
           "--speculative", "oracle", "--speculative-num-draft-tokens", "4", "runtime.num_threads=1"]
    if accept_len is not None:
        cmd.append(f"speculative.options.accept_len={accept_len}")
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert row["speculative"] == "oracle" and row["spec_accept_length"] == pytest.approx(expected)
    assert row["decode_tok_s"] > 0 and "accept_length" in r.stdout
    # audit 29: ms/step and tok/s did not reconcile. Every timed step here is a verify of both requests
    # (2 x accept length tokens); tok/s is tokens per step over the mean step time, not the median
    assert row["decode_tokens_per_step"] == pytest.approx(2 * expected)
    assert row["decode_steps"] * row["decode_tokens_per_step"] == pytest.approx(2 * (output_len - 1))
    assert row["decode_tok_s"] == pytest.approx(row["decode_tokens_per_step"] / row["decode_ms_per_step_mean"] * 1e3,
                                                rel=0.01)
    line = next(x for x in r.stdout.splitlines() if "speculative=oracle" in x)
    for label in ("p50", "ms/step", "mean", "tok/step", "tokens / summed step time", "tokens per request verify"):
        assert label in line, line
