"""What a live server runs (plugin-author audit 37, G1): the start-up log's `stack:` line names each component
with the options it is built with, and the runner's `resolved_stack_info()` (sent to the front end at start-up,
shown by /server_info as `resolved_stack`) has their names, distributions and options."""

from __future__ import annotations

import logging

from radixserve.config import Config
from radixserve.model_runner import ModelRunner


def test_the_stack_line_and_the_resolved_stack_carry_the_options(tiny_llama_dir, caplog):
    config = Config.build({
        "model": {"path": tiny_llama_dir("llama")},
        "runtime": {"device": "cpu"},
        "stack": {"policy": "lpm", "policy_options": {"fcfs_threshold": 5}, "speculative": "oracle"},
        "speculative": {"options": {"accept_len": 2}},
    })
    with caplog.at_level(logging.INFO, logger="radixserve.model_runner"):
        runner = ModelRunner(config, show_progress=False)
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("stack: "))
    assert "policy lpm {'fcfs_threshold': 5}" in line and "drafter oracle {'accept_len': 2}" in line, line
    assert "prefix_cache radix," in line  # a component without options is named alone, as before
    info = runner.resolved_stack_info()
    assert info["policy"] == {"name": "lpm", "distribution": "radixserve-policies",
                              "version": info["policy"]["version"], "options": {"fcfs_threshold": 5}}
    assert info["drafter"]["name"] == "oracle" and info["drafter"]["options"] == {"accept_len": 2}
    assert info["prefix_cache"]["name"] == "radix" and info["prefix_cache"]["options"] == {}  # stack.prefix_cache_options
    assert info["attention"]["name"] and info["attention"]["distribution"]
    assert info["quantization"] is None or info["quantization"]["origin"] in ("stack", "checkpoint", "default")


def test_server_info_shows_what_the_scheduler_runs(tiny_llama_dir, tmp_path):
    """From the scheduler process's start-up report through the front end to /server_info (a tiny checkpoint)."""
    import httpx
    from server_process import ServerProcess, with_tiny_tokenizer

    srv = ServerProcess(["--model", with_tiny_tokenizer(tiny_llama_dir("llama")), "scheduler.max_total_tokens=2048",
                         "runtime.num_threads=1", "stack.policy=lpm", "stack.policy_options.fcfs_threshold=5"],
                        tmp_path / "server.log", 300)
    try:
        info = httpx.get(f"{srv.url}/server_info", timeout=60).json()
        logs = srv.logs()
    finally:
        srv.stop()
    stack = info["resolved_stack"]
    assert stack["policy"]["name"] == "lpm" and stack["policy"]["options"] == {"fcfs_threshold": 5}, stack
    assert stack["policy"]["distribution"] == "radixserve-policies" and stack["drafter"] is None
    assert info["config"]["stack"]["attention"] is None and stack["attention"]["name"]  # given vs. resolved
    assert "policy lpm {'fcfs_threshold': 5}" in logs, logs
