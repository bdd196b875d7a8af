"""Command-line configuration edge cases from the operator audit (audit28/cli.md): empty API keys,
where $RADIXSERVE_API_KEY sits in the precedence chain, and friends."""

from __future__ import annotations

import pytest
from radixserve.cli import main, make_parser, parse_command_line
from radixserve.cli_serve import serve_config
from radixserve.config import Config, ConfigError, parse_dotted_overrides


def _serve_config(argv: list[str]):
    return serve_config(parse_command_line(make_parser(), ["serve", *argv]))


@pytest.mark.parametrize("source", ["override", "yaml"])
def test_an_empty_api_key_in_the_config_is_refused_like_the_flag(tmp_path, monkeypatch, capsys, source):
    # "" would turn authentication off while the ready line says "(API key required)"
    monkeypatch.delenv("RADIXSERVE_API_KEY", raising=False)
    f = tmp_path / "k.yaml"
    f.write_text("server:\n  api_key: ''\n")
    argv = ["--config", str(f)] if source == "yaml" else ["server.api_key=''"]
    with pytest.raises(ConfigError, match="server.api_key.*empty"):  # serve's config (not started: no hang)
        _serve_config(argv)
    assert main(["config", "show", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "server.api_key" in err and "empty" in err, err
    with pytest.raises(ConfigError, match="server.api_key"):
        Config.load(None, parse_dotted_overrides(["server.api_key='  '"]))


@pytest.mark.parametrize("override,key", [("server.api_key=0x1F", "0x1F"), ("server.api_key=017", "017"),
                                          ("server.api_key='k1 #note'", "k1 #note"), ("server.api_key=[1", "[1")])
def test_an_override_api_key_is_taken_as_typed(override, key):
    """Operator audit 34: read as YAML, `0x1F` became the key "31" and `'k1 #note'` lost its end."""
    assert Config.load(None, parse_dotted_overrides([override])).server.api_key == key


@pytest.mark.parametrize("line,message", [("  api_key:\n", "is given with no value"),
                                          ("  api_key: 0x1F\n", "must be a string, but YAML read the value as int 31")])
def test_a_yaml_api_key_must_be_a_string(tmp_path, monkeypatch, line, message):
    """Operator audit 34: `api_key:` with no value served without authentication, and a number was rewritten."""
    monkeypatch.delenv("RADIXSERVE_API_KEY", raising=False)
    f = tmp_path / "k.yaml"
    f.write_text("server:\n" + line)
    with pytest.raises(ConfigError, match=f"server.api_key {message}"):
        _serve_config(["--config", str(f)])
    with pytest.raises(ConfigError, match="server.api_key.*empty"):  # `server.api_key=$UNSET` on a command line
        _serve_config(["server.api_key="])


def test_an_empty_environment_key_is_refused_where_it_would_apply(monkeypatch, capsys):
    monkeypatch.setenv("RADIXSERVE_API_KEY", "")
    with pytest.raises(ConfigError, match="RADIXSERVE_API_KEY is set but empty"):
        _serve_config([])
    assert main(["config", "show"]) == 2
    assert "RADIXSERVE_API_KEY is set but empty" in capsys.readouterr().err
    assert _serve_config(["--api-key", "k1"]).server.api_key == "k1"  # not used: nothing to refuse


def test_vllms_key_variable_alone_is_refused_not_served_open(monkeypatch, capsys):
    """Migration audit 31: VLLM_API_KEY carried over from a vLLM deployment left the server without a key."""
    monkeypatch.delenv("RADIXSERVE_API_KEY", raising=False)
    monkeypatch.setenv("VLLM_API_KEY", "secret")
    with pytest.raises(ConfigError, match="VLLM_API_KEY is set, but RadixServe reads its API key from "
                                          "RADIXSERVE_API_KEY or --api-key"):
        _serve_config([])
    assert _serve_config(["--api-key", "k1"]).server.api_key == "k1"  # a key of its own: nothing to refuse
    monkeypatch.setenv("RADIXSERVE_API_KEY", "envkey")
    assert _serve_config([]).server.api_key == "envkey"


def test_the_environment_key_is_a_default_under_yaml_overrides_and_flags(tmp_path, monkeypatch):
    monkeypatch.setenv("RADIXSERVE_API_KEY", "envkey")
    f = tmp_path / "k.yaml"
    f.write_text("server:\n  api_key: yamlkey\n")
    assert _serve_config([]).server.api_key == "envkey"
    assert _serve_config(["--config", str(f)]).server.api_key == "yamlkey"
    assert _serve_config(["--config", str(f), "server.api_key=ovrkey"]).server.api_key == "ovrkey"
    assert _serve_config(["server.api_key=ovrkey"]).server.api_key == "ovrkey"
    assert _serve_config(["--config", str(f), "server.api_key=ovrkey", "--api-key", "flagkey"]).server.api_key == "flagkey"


def test_serve_reports_a_value_the_scheduler_refuses_as_one_line_with_exit_2(tiny_llama_dir):
    """A bad value only the scheduler process detects at start-up (the model's maximum context): exit 2
    and `radixserve: error: ...`, as `generate` gives, carried by ChildFailed.user_error."""
    from plugin_fixtures import run_cli
    from server_process import with_tiny_tokenizer

    model = with_tiny_tokenizer(tiny_llama_dir("llama"))
    r = run_cli(["serve", "--model", model, "--port", "0", "model.context_length=100000", "runtime.num_threads=1"])
    assert r.returncode == 2, r.stderr
    errors = [line for line in r.stderr.splitlines() if "context_length" in line]
    assert len(errors) == 1 and errors[0].startswith("radixserve: error: "), r.stderr
    assert "Traceback" not in r.stderr and "process failed" not in r.stderr, r.stderr


def test_a_cross_field_error_names_the_fields_not_the_whole_section():
    with pytest.raises(ConfigError) as e:
        Config.load(None, {"runtime": {"nnodes": 2, "dist_init_addr": "h:1"}})
    assert "runtime.tp_size=1 must be a multiple of runtime.nnodes=2" in str(e.value)
    assert "'device'" not in str(e.value) and "{" not in str(e.value)


def test_data_parallel_over_multi_node_tensor_parallelism_is_refused_up_front():
    """Parallelism audit 31: both replicas took the one rendezvous address (EADDRINUSE, a torch traceback)."""
    with pytest.raises(ConfigError, match=r"runtime.dp_size=2 with runtime.nnodes=2: data-parallel replicas run on "
                                          r"one machine"):
        Config.load(None, {"runtime": {"dp_size": 2, "tp_size": 2, "nnodes": 2, "dist_init_addr": "127.0.0.1:1234"}})


@pytest.mark.parametrize("addr", ["127.0.0.1:99999", "127.0.0.1:0", "h:65536"])
def test_a_rendezvous_port_out_of_range_is_refused(addr):
    with pytest.raises(ConfigError, match="the port must be 1-65535"):
        Config.load(None, {"runtime": {"dist_init_addr": addr}})
    assert Config.load(None, {"runtime": {"dist_init_addr": "h:65535"}}).runtime.dist_init_addr == "h:65535"


def test_serve_refuses_tp_size_and_points_to_tp(capsys):
    # docs/configuration.md lists --tp-size among the refused vLLM/SGLang flags, as config show and bench refuse it
    with pytest.raises(SystemExit) as e:
        parse_command_line(make_parser(), ["serve", "--tp-size", "2"])
    assert e.value.code == 2
    assert "--tp-size (vLLM/SGLang) -> --tp N (runtime.tp_size)" in capsys.readouterr().err
    assert _serve_config(["--tp", "2"]).runtime.tp_size == 2


def test_a_repeated_yaml_key_or_section_is_an_error_naming_it_and_the_lines(tmp_path):
    f = tmp_path / "dup.yaml"
    f.write_text("stack:\n  policy: lpm\n  prefix_cache: chunk\nstack:\n  policy: fcfs\n")
    with pytest.raises(ConfigError, match=r"key 'stack' is given twice \(lines 1 and 4\)"):
        Config.load(f)
    f.write_text("scheduler:\n  max_running_requests: 8\n  max_running_requests: 9\n")
    with pytest.raises(ConfigError, match=r"'max_running_requests' is given twice \(lines 2 and 3\)"):
        Config.load(f)
    f.write_text("stack: &s {policy: lpm}\nspeculative:\n  options: {a: 1}\n")  # anchors etc. still load
    assert Config.load(f).stack.policy == "lpm"


def test_an_allow_list_entry_naming_no_plugin_is_reported(caplog, monkeypatch):
    from radixserve.plugins.registry import Registry

    monkeypatch.setenv("RADIXSERVE_PLUGINS", "radix,policies,llama,no_such_plugin_xyz")
    with caplog.at_level("WARNING", logger="radixserve.plugins.registry"):
        Registry.discover()
    text = caplog.text
    assert "RADIXSERVE_PLUGINS names 'no_such_plugin_xyz', which is no installed plugin: nothing is loaded by it" in text
    assert "'radix'" not in text and "'core'" not in text, text


def test_p_no_without_a_name_is_an_error(capsys):
    assert main(["config", "show", "-p", "no:"]) == 2
    assert "the plugin name is missing" in capsys.readouterr().err


@pytest.mark.parametrize("command", [["serve", "--port", "0"], ["generate", "hi"]])
def test_an_unwritable_cache_dir_is_one_line_and_exit_2_before_any_model_work(tmp_path, command):
    """Operator audit 30: RADIXSERVE_CACHE_DIR under a file (or read-only) failed after 8-23 s with a
    35-line traceback, exit 1, and a last line blaming the tokenizer."""
    import os
    import subprocess
    import sys
    import time

    blocker = tmp_path / "afile"
    blocker.write_text("")
    env = {**os.environ, "RADIXSERVE_CACHE_DIR": str(blocker / "cache")}
    started = time.monotonic()
    run = subprocess.run([sys.executable, "-m", "radixserve.cli", *command], capture_output=True, text=True,
                         env=env, timeout=120)
    assert run.returncode == 2, run.stderr[-3000:]
    assert run.stderr.strip().splitlines()[-1] == (
        f"radixserve: error: RADIXSERVE_CACHE_DIR '{blocker / 'cache'}' cannot be written (Not a directory): RadixServe "
        "keeps its built native kernels and prepared tokenizers there; set RADIXSERVE_CACHE_DIR to a writable directory")
    assert "Traceback" not in run.stderr and time.monotonic() - started < 60


@pytest.mark.parametrize("extra", [[], ["--tokenizer", "TOKDIR"]])
def test_a_model_file_no_weight_source_reads_is_named_first(tmp_path, extra, smollm2_gguf_path):
    """Operator audit 30: a YAML given as --model failed with exit 1 and a tokenizer message, or (with
    --tokenizer) after 11 s behind an ERROR line about the scheduler; one cause, one line, exit 2."""
    import os
    import subprocess
    import sys

    model = tmp_path / "stack.yaml"
    model.write_text("a: b\n")
    extra = [os.path.dirname(smollm2_gguf_path) if a == "TOKDIR" else a for a in extra]
    run = subprocess.run([sys.executable, "-m", "radixserve.cli", "serve", "--port", "0", "--model", str(model), *extra],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stderr[-3000:]
    assert run.stderr.strip().splitlines() == [
        f"radixserve: error: model file '{model}': no installed weight source reads this file type (installed ones "
        "read: .gguf); or pass an HF directory"]


@pytest.mark.parametrize("name", ["", "  "])
def test_an_empty_served_model_name_is_refused_like_an_empty_key(name):
    """Operator audit 30: --served-model-name "" was accepted and the file name served instead."""
    with pytest.raises(ConfigError, match=r"model.served_model_name: .*must not be empty"):
        _serve_config(["--served-model-name", name])


REMOTE_CONFIG = """
import os
open(os.path.join(os.path.dirname(__file__), "RAN"), "w").close()
from transformers import PretrainedConfig
class TinyConfig(PretrainedConfig):
    model_type = "tinyremote"
"""


def test_a_checkpoints_own_code_is_never_run_nor_offered(tmp_path):
    """Models audit 30: a config.json with auto_map and an unknown model_type made `config show` and
    `generate` show transformers' "run the custom code? [y/N]" prompt, and "y" ran the checkpoint's code."""
    import json
    import subprocess
    import sys

    import torch
    from safetensors.torch import save_file

    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "tinyremote", "architectures": ["TinyRemoteForCausalLM"], "vocab_size": 32, "hidden_size": 8,
        "auto_map": {"AutoConfig": "configuration_tiny.TinyConfig"}}))
    (tmp_path / "configuration_tiny.py").write_text(REMOTE_CONFIG)
    save_file({"x": torch.zeros(1)}, str(tmp_path / "model.safetensors"))
    run = subprocess.run([sys.executable, "-m", "radixserve.cli", "config", "show", "--model", str(tmp_path)],
                         input="y\ny\ny\n", capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stderr[-3000:]
    assert not (tmp_path / "RAN").exists()
    assert "[y/N]" not in run.stdout + run.stderr
    assert "names its own Python code (config.json auto_map), which RadixServe never runs" in run.stderr


def test_load_format_names_any_installed_weight_source(tmp_path, smollm2_gguf_path):
    """Weight-source audit 34: model.load_format was a fixed list (auto, safetensors, gguf, dummy), so a plugin's weight
    source could not be named, nor a file read whose suffix its source did not declare; an unknown name is refused
    before the model loads, listing the installed sources."""
    import shutil
    import subprocess
    import sys

    renamed = tmp_path / "smollm2.weights"  # a GGUF file under a suffix no source declares
    shutil.copy(smollm2_gguf_path, renamed)
    tokenizer = tmp_path / "tok"
    from radixserve.tokenizer import load_tokenizer

    load_tokenizer(smollm2_gguf_path).save_pretrained(tokenizer)

    def generate(*extra):
        return subprocess.run([sys.executable, "-m", "radixserve.cli", "generate", "--model", str(renamed), "--tokenizer",
                               str(tokenizer), "--no-chat", "--max-tokens", "3", "The capital of France is", *extra],
                              capture_output=True, text=True, timeout=300)

    named = generate("model.load_format=gguf", "runtime.num_threads=1")
    assert named.returncode == 0 and named.stdout.strip(), named.stderr[-3000:]
    unknown = generate("model.load_format=npzw")
    assert unknown.returncode == 2 and unknown.stderr.strip().splitlines() == [
        "radixserve: error: model.load_format='npzw': not auto, safetensors, dummy or an installed weight source "
        "(installed weight sources: gguf)"], unknown.stderr[-3000:]
    by_suffix = generate()  # auto: the suffix decides, and no source declared it
    assert by_suffix.returncode == 2 and "no installed weight source reads this file type" in by_suffix.stderr
    # CPU-deployer audit 35: the quantization check and `config show` went by the suffix, not by load_format
    def config_show(*extra):
        return subprocess.run([sys.executable, "-m", "radixserve.cli", "config", "show", "--model", str(renamed),
                               "model.load_format=gguf", *extra], capture_output=True, text=True, timeout=120)

    shown = config_show()
    assert shown.returncode == 0 and "  quantization: gguf  # the weight source model.load_format names" in shown.stdout
    refused = config_show("stack.quantization=fp8")  # resolve_stack's check: serve and generate run it too
    assert refused.returncode == 2 and refused.stderr.strip().splitlines()[-1].startswith(
        f"radixserve: error: stack.quantization='fp8' cannot apply to '{renamed}': that file is read by the weight "
        "source 'gguf'"), refused.stderr[-2000:]


def test_generate_prints_the_speculative_summary_on_its_own_line(tiny_llama_dir):
    """Plugin audit 37: `generate --speculative ...` glued "[speculative: N verify steps, ...]" to the text on a
    terminal when the output ended at --max-tokens (the summary came from the generator's clean-up, before the
    text's newline). One pipe for both streams, as a terminal shows them."""
    import subprocess
    import sys

    from server_process import with_tiny_tokenizer

    model = with_tiny_tokenizer(tiny_llama_dir("llama"))
    r = subprocess.run([sys.executable, "-m", "radixserve.cli", "generate", "--model", model, "--no-chat",
                        "--max-tokens", "12", "--temperature", "0", "--speculative", "ngram", "a b a b a b a b",
                        "runtime.num_threads=1"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout[-3000:]
    summary = [line for line in r.stdout.splitlines() if "[speculative:" in line]
    assert len(summary) == 1 and summary[0].startswith("[speculative:"), r.stdout[-3000:]
