"""Configuration: precedence, unknown keys, unknown components, `radixserve config show`."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import yaml
from plugin_fixtures import run_cli
from pydantic import ValidationError
from radixserve.config import Config, ConfigError, parse_dotted_overrides
from radixserve.plugins.registry import PluginError, Registry
from radixserve.plugins.stack import resolve_stack

REPO = Path(__file__).resolve().parents[1]


def test_precedence_cli_over_yaml_over_defaults(tmp_path):
    f = tmp_path / "s.yaml"
    f.write_text("stack:\n  policy: lpm\nscheduler:\n  chunked_prefill_size: 64\n  max_running_requests: 8\n")
    cfg = Config.load(f, parse_dotted_overrides(["scheduler.chunked_prefill_size=16"]))
    assert cfg.scheduler.chunked_prefill_size == 16  # CLI beats YAML
    assert cfg.scheduler.max_running_requests == 8  # YAML beats default
    assert cfg.stack.policy == "lpm"
    assert cfg.server.host == "127.0.0.1"  # default


def test_unknown_key_lists_valid_keys(tmp_path):
    f = tmp_path / "s.yaml"
    f.write_text("scheduler:\n  chunk_size: 16\n")
    with pytest.raises(ConfigError) as e:
        Config.load(f)
    assert "scheduler.chunk_size" in str(e.value) and "chunked_prefill_size" in str(e.value)


def test_unknown_section_and_bad_values_are_errors(tmp_path):
    with pytest.raises(ConfigError, match="unknown key 'schedular'"):
        Config.build({"schedular": {}})
    with pytest.raises(ConfigError, match="runtime.dtype"):
        Config.build({"runtime": {"dtype": "float8"}})
    with pytest.raises(ConfigError, match="must look like section.key=value"):
        parse_dotted_overrides(["policy=lpm"])


def test_configs_are_frozen():
    cfg = Config()
    with pytest.raises(ValidationError):
        cfg.stack.policy = "lpm"  # type: ignore[misc]
    assert cfg.with_overrides({"stack": {"policy": "lpm"}}).stack.policy == "lpm"
    assert cfg.stack.policy == "fcfs"


def test_unknown_component_names_kind_name_and_alternatives():
    reg = Registry.discover()
    cfg = Config.build({"stack": {"policy": "does-not-exist"}})
    with pytest.raises(PluginError) as e:
        resolve_stack(cfg, reg, "cpu")
    msg = str(e.value)
    assert "policy" in msg and "does-not-exist" in msg and "fcfs" in msg


def test_config_show_cpu_stack():
    r = run_cli(["config", "show", "--config", str(REPO / "stacks" / "cpu.yaml")])
    assert r.returncode == 0, r.stderr
    assert "resolved_stack:" in r.stdout and "policy: fcfs" in r.stdout and "device: cpu" in r.stdout


def test_config_show_cpu_bf16_stack():
    r = run_cli(["config", "show", "--config", str(REPO / "stacks" / "cpu-bf16.yaml")])
    assert r.returncode == 0, r.stderr
    assert "cpu_matmul_precision: medium" in r.stdout and "kv_cache_dtype: bfloat16" in r.stdout
    assert "attention: cpu_batched" in r.stdout


def test_config_show_shows_and_checks_the_output_parsers():
    """An outsider selecting a plugin tool parser could not see it in `config show`, and a typo
    passed there (only `serve` refused it)."""
    r = run_cli(["config", "show", "server.tool_call_parser=hermes", "server.reasoning_parser=none"])
    assert r.returncode == 0, r.stderr
    assert "tool_parser: hermes  # server.tool_call_parser; radixserve " in r.stdout
    assert "reasoning_parser: none  # server.reasoning_parser" in r.stdout
    r = run_cli(["config", "show", "server.tool_call_parser=hermez"])
    assert r.returncode == 2 and "server.tool_call_parser='hermez'" in r.stderr and "hermes" in r.stderr
    assert "Traceback" not in r.stderr


def test_config_show_names_bad_component_without_traceback(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("stack:\n  prefix_cache: radixx\n")
    r = run_cli(["config", "show", "--config", str(f)])
    assert r.returncode == 2
    assert "prefix_cache" in r.stderr and "radixx" in r.stderr and "Traceback" not in r.stderr


def test_cli_bad_model_path_is_one_line_error(tmp_path):
    missing = str(tmp_path / "no-such-model")
    r = run_cli(["generate", "--model", missing, "hello"])
    assert r.returncode == 2
    assert missing in r.stderr and "does not exist" in r.stderr and "Traceback" not in r.stderr


def test_overlap_defaults_on_for_cuda_off_for_cpu_and_can_be_forced():
    rt = Config.build({}).runtime
    assert rt.resolved_overlap("cuda") and rt.resolved_overlap("cuda:0") and not rt.resolved_overlap("cpu")
    assert Config.build({"runtime": {"overlap": True}}).runtime.resolved_overlap("cpu")
    assert not Config.build({"runtime": {"overlap": False}}).runtime.resolved_overlap("cuda")


def test_prefill_chunking_and_mixed_batches_default_per_device_and_can_be_forced():
    sc = Config.build({}).scheduler
    assert sc.resolved_chunked_prefill_size("cpu") == 512 and sc.resolved_chunked_prefill_size("cuda:0") == 2048
    assert sc.resolved_enable_mixed_chunk("cpu") and not sc.resolved_enable_mixed_chunk("cuda")
    assert not sc.resolved_enable_mixed_chunk("cpu", speculative=True)
    forced = Config.build({"scheduler": {"chunked_prefill_size": 2048, "enable_mixed_chunk": False}}).scheduler
    assert forced.resolved_chunked_prefill_size("cpu") == 2048 and not forced.resolved_enable_mixed_chunk("cpu")
    off = Config.build({"scheduler": {"chunked_prefill_size": -1, "enable_mixed_chunk": True}}).scheduler
    assert off.resolved_chunked_prefill_size("cuda") is None and off.resolved_enable_mixed_chunk("cuda")


def test_a_config_path_that_is_no_yaml_text_is_named(tmp_path):
    # a directory said "does not exist"; a binary file gave a decode error without the file's name
    binary = tmp_path / "stack.yaml"
    binary.write_bytes(b"\xff\xfe\x00")
    for path, words in ((tmp_path, "is a directory"), (binary, "cannot be read as UTF-8 text")):
        r = run_cli(["config", "show", "--config", str(path)])
        assert r.returncode == 2 and str(path) in r.stderr and words in r.stderr, r.stderr
        assert "Traceback" not in r.stderr


def test_a_config_from_a_device_or_a_pipe_is_read(tmp_path):
    """Was: /dev/null and bash's <(...) (a /dev/fd pipe) said "does not exist"; they are read as files are."""
    r = run_cli(["config", "show", "--config", "/dev/null"])
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    fifo = tmp_path / "stack.fifo"
    os.mkfifo(fifo)
    writer = subprocess.Popen(["sh", "-c", f"printf 'scheduler:\\n  max_running_requests: 7\\n' > {fifo}"])
    r = run_cli(["config", "show", "--config", str(fifo)])
    writer.wait(timeout=30)
    assert r.returncode == 0 and "max_running_requests: 7" in r.stdout, r.stderr


def test_config_show_says_which_implementation_runs_a_checkpoint(tmp_path):
    from radixserve.testing import tiny_checkpoint

    ckpt = tiny_checkpoint("llama", tmp_path / "tiny")
    r = run_cli(["config", "show", "--model", str(ckpt)])
    assert r.returncode == 0, r.stderr
    shown = yaml.safe_load(r.stdout)  # one YAML document: the implementation has its own key beside `model:`
    assert "native plugin 'llama'" in shown["model_implementation"], r.stdout
    assert shown["model"]["path"] == str(ckpt)
    forced = run_cli(["config", "show", "--model", str(ckpt), "model.impl=transformers"])
    assert "transformers fallback" in yaml.safe_load(forced.stdout)["model_implementation"], forced.stdout + forced.stderr


def test_config_show_lists_the_plugins_it_skipped_and_why():
    """plugins.disable is visible in the YAML; RADIXSERVE_DISABLE_PLUGINS was not, so an operator could not see
    from `config show` why a component was missing."""
    r = run_cli(["config", "show", "-p", "no:ngram"], env={"RADIXSERVE_DISABLE_PLUGINS": "llguidance"})
    assert r.returncode == 0, r.stderr
    skipped = yaml.safe_load(r.stdout)["skipped_plugins"]
    assert skipped == {"llguidance": "RADIXSERVE_DISABLE_PLUGINS", "ngram": "plugins.disable"}, r.stdout


def test_config_show_output_reads_back_as_a_stack_file(tmp_path):
    """CPU-deployer audit 35: `config show` printed `api_key: null`, which the file check refuses, so its output (the
    sections above `# resolved for device`, as docs/configuration.md says to reuse it) did not read back."""
    first = run_cli(["config", "show", "--config", str(REPO / "stacks" / "cpu-bf16.yaml"), "stack.policy=lpm"])
    assert first.returncode == 0, first.stderr
    stack = tmp_path / "roundtrip.yaml"
    stack.write_text(first.stdout.split("# resolved", 1)[0])
    again = run_cli(["config", "show", "--config", str(stack)])
    assert again.returncode == 0, again.stderr
    assert again.stdout == first.stdout


def test_config_show_takes_a_tokenizer_and_hints_at_overrides_for_serve_flags():
    """CPU-deployer audit 35: `config show --tokenizer DIR` was refused with a hint naming --tokenizer itself, and
    `--port` got no hint at all."""
    missing = run_cli(["config", "show", "--tokenizer", "/no/such/tokenizer"])
    assert missing.returncode == 2 and "tokenizer path '/no/such/tokenizer' (model.tokenizer, --tokenizer)" in missing.stderr
    shown = run_cli(["config", "show", "--tokenizer", str(REPO / "docs")])
    assert shown.returncode == 0 and f"  tokenizer: {REPO / 'docs'}" in shown.stdout, shown.stderr
    port = run_cli(["config", "show", "--port", "8000"])
    assert port.returncode == 2 and "(--port is server.port=8000)" in port.stderr, port.stderr
