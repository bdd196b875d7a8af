"""`radixserve bench one-batch` and its static-batch driver on a tiny checkpoint (CPU)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from radixserve.bench.static_batch import StaticBatchDriver
from radixserve.config import Config
from radixserve.model_runner import ModelRunner
from runner_driver import greedy_generate


@pytest.fixture(scope="module")
def tiny_path(tiny_llama_dir):
    return tiny_llama_dir("llama")


def test_static_batch_driver_matches_greedy_reference(tiny_path):
    cfg = Config.build({
        "model": {"path": tiny_path},
        "runtime": {"device": "cpu", "num_threads": 1},
        "scheduler": {"max_total_tokens": 1024, "max_running_requests": 4},
    })
    runner = ModelRunner(cfg, show_progress=False)
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6], [5, 3, 5, 8, 9, 7]]
    res = StaticBatchDriver(runner).run(prompts, 6)
    ref = greedy_generate(runner, prompts, 6)
    assert res.output_ids == [g.tokens for g in ref]
    assert len(res.decode_step_s) == 5 and res.prefill_s > 0
    assert runner.token_allocator.available_size() == runner.token_allocator.size  # everything freed


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
