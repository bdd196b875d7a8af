"""What a user coming from vLLM or SGLang types first, found by a migrant's audit (session 26): their
flags and Engine keywords answered with RadixServe's spelling, and the start-up mistakes (an empty API
key, a tokenizer path that does not exist, a CUDA device torch cannot use, a context beyond the
model's positions, an override that is not YAML, generate's prompt among overrides) each one line
naming the value, before anything loads, never a traceback or a silent fallback."""

from __future__ import annotations

import pytest
import torch
from radixserve.cli import main
from radixserve.cli_generate import split_prompt
from radixserve.config import Config, ConfigError, parse_dotted_overrides
from radixserve.engine import engine_config
from radixserve.model_runner import ModelRunner


def test_a_vllm_flag_is_refused_with_its_spelling_here_under_the_commands_usage(capsys):
    with pytest.raises(SystemExit) as e:
        main(["serve", "--max-model-len", "512", "--trust-remote-code", "--no-such-flag"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "usage: radixserve serve" in err and "radixserve serve: error: unrecognized arguments" in err
    assert "--max-model-len (vLLM/SGLang) -> model.context_length=N" in err
    assert "--trust-remote-code (vLLM/SGLang) -> not needed" in err
    assert "--no-such-flag (vLLM" not in err


@pytest.mark.parametrize("flag", ["--api-key", "--served-model-name"])
def test_a_one_value_flag_given_twice_is_an_error_not_the_last_one(capsys, flag):
    """Migration audit 31: `--api-key k1 --api-key k2` kept k2 alone, silently (vLLM takes several keys)."""
    with pytest.raises(SystemExit) as e:
        main(["serve", flag, "secret1", flag, "secret2"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"{flag} given twice: this server takes one" in err, err
    assert "secret" not in err  # a key is not echoed to the terminal or a log


def test_vllms_short_tp_flag_gets_its_spelling_too(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "-tp", "2", "--enable-chunked-prefill"])
    err = capsys.readouterr().err
    assert "-tp (vLLM/SGLang) -> --tp N (runtime.tp_size)" in err
    assert "--enable-chunked-prefill (vLLM/SGLang) -> not needed: prefill is chunked by default" in err


@pytest.mark.parametrize("keyword,spelling", [
    ("max_model_len", "as Engine(model={'path': ..., 'context_length': ...});"),  # audit 34: not Engine(path, model=)
    ("dtype", "as Engine(..., runtime={'dtype': ...});"),
    ("tensor_parallel_size", "as Engine(..., runtime={'tp_size': ...});"),
    ("model_path", "as Engine(model={'path': ...});"),
])
def test_an_engine_keyword_of_vllm_says_how_the_engine_spells_it(keyword, spelling):
    with pytest.raises(ConfigError) as e:
        engine_config(None, None, None, {keyword: 1})
    assert str(e.value).startswith(f"Engine has no argument {keyword}=") and spelling in str(e.value)
    assert "model, plugins, router, runtime, scheduler, server, speculative, stack" in str(e.value)


def test_engine_speculative_settings_need_a_drafter():
    """Audit 34: speculative={...} without stack.speculative started with speculation off, without a word;
    speculative="ngram" (the vLLM habit) did not say where the drafter's name goes."""
    with pytest.raises(ConfigError, match=r"speculative settings \(num_draft_tokens\) have no effect without a drafter"):
        engine_config(None, None, None, {"speculative": {"num_draft_tokens": 6}})
    with pytest.raises(ConfigError, match=r"the drafter itself is stack=\{'speculative': 'ngram'\}"):
        engine_config(None, None, None, {"speculative": "ngram"})
    config = engine_config(None, None, None, {"speculative": {"num_draft_tokens": 6}, "stack": {"speculative": "ngram"}})
    assert config.speculative.num_draft_tokens == 6
    assert main(["config", "show", "speculative.num_draft_tokens=3"]) == 2  # a YAML file's or the CLI's section
    assert main(["config", "show", "speculative.num_draft_tokens=3", "stack.speculative=ngram"]) == 0


def test_engine_arguments_are_taken_as_typed():
    """Audit 34: tp_size="2" started the runtime and failed 13 s later; Engine(123) said path '123' is missing."""
    with pytest.raises(ConfigError, match=r"^tp_size= must be an int, got str '2'$"):
        engine_config(None, None, "2", {})
    with pytest.raises(ConfigError, match=r"^model= takes a checkpoint's path .* got int 123$"):
        engine_config(123, None, None, {})


def test_an_unknown_engine_keyword_lists_the_sections():
    with pytest.raises(ConfigError, match="Engine has no argument foo=: the config sections it takes are model"):
        engine_config(None, None, None, {"foo": {}})


def test_an_override_that_is_not_yaml_is_one_line(capsys):
    assert main(["config", "show", "stack.policy_options={fcfs_threshold: 64"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("radixserve: error: override 'stack.policy_options={fcfs_threshold: 64': the value is not "
                          "valid YAML") and "Traceback" not in err


def test_a_model_path_where_an_override_goes_points_to_model(capsys, tmp_path):
    assert main(["config", "show", str(tmp_path)]) == 2
    assert f"to serve a model give it as --model {tmp_path}" in capsys.readouterr().err


def test_numbers_in_string_overrides_stay_strings():
    config = Config.load(None, parse_dotted_overrides(["server.api_key=123", "model.served_model_name=2024"]))
    assert config.server.api_key == "123" and config.model.served_model_name == "2024"
    # operator audit 34: YAML's other readings of a string key's value were rewritten ('0x1F' -> '31')
    for typed in ("0x1F", "1.50", "yes", "2024-01-01", "1_000"):
        config = Config.load(None, parse_dotted_overrides([f"model.served_model_name={typed}"]))
        assert config.model.served_model_name == typed
    assert parse_dotted_overrides(["scheduler.mem_fraction=0.5", "runtime.overlap=false"]) == {
        "scheduler": {"mem_fraction": 0.5}, "runtime": {"overlap": False}}  # typed keys still read as YAML


@pytest.mark.parametrize("first,rest,prompt,overrides", [
    ("stack.policy=lpm", ["Hello there"], "Hello there", ["stack.policy=lpm"]),
    ("Hello there", ["stack.policy=lpm"], "Hello there", ["stack.policy=lpm"]),
    ("x.y=1 is a prompt", [], "x.y=1 is a prompt", []),  # not a config section: a prompt
])
def test_generate_finds_its_prompt_among_the_overrides(first, rest, prompt, overrides):
    assert split_prompt(first, rest) == (prompt, overrides)


def test_generate_refuses_a_run_without_a_prompt_or_with_two():
    # the audit's case: a mistyped override alone was generated from, as the prompt
    with pytest.raises(ConfigError, match="takes one prompt, got none"):
        split_prompt("stack.polcy=lpm", [])
    with pytest.raises(ConfigError, match="takes one prompt, got 2: 'a', 'b'"):
        split_prompt("a", ["b"])


@pytest.mark.parametrize("argv,words", [
    (["generate", "--max-tokens", "0", "hi"], "--max-tokens 0: must be at least 1"),
    (["serve", "--api-key", ""], "--api-key is empty"),
    (["serve", "--tokenizer", "/nonexistent/tokenizer"], "tokenizer path '/nonexistent/tokenizer'"),
])
def test_start_up_mistakes_are_one_line_before_anything_loads(capsys, argv, words):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("radixserve: error: ") and words in err, err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch that cannot use CUDA")
def test_cuda_on_a_torch_without_it_is_one_line(capsys):
    assert main(["serve", "runtime.device=cuda"]) == 2
    assert "runtime.device=cuda, but" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="runtime.device=cuda, but"):
        ModelRunner(Config.build({"runtime": {"device": "cuda"}}))


def test_a_context_beyond_the_models_positions_is_refused(tiny_llama_dir):
    path = tiny_llama_dir("llama")
    with pytest.raises(ValueError, match=r"model.context_length=100000 is beyond what this model's positions cover \(512"):
        ModelRunner(Config.build({"model": {"path": path, "context_length": 100000}}), show_progress=False)
    runner = ModelRunner(Config.build({"model": {"path": path, "context_length": 256}}), show_progress=False)
    assert runner.context_len == 256


@pytest.mark.parametrize("impl", ["auto", "transformers"])
def test_dynamic_rope_scaling_is_refused_naming_it_on_both_paths(tiny_llama_dir, impl):
    """Models audit 32: natively a NotImplementedError from the rotary inside the child; through the
    fallback a short request's tokens changed when a long one shared its batch."""
    path = tiny_llama_dir("llama", rope_scaling={"rope_type": "dynamic", "factor": 4.0})
    with pytest.raises(ValueError, match=r"architecture LlamaForCausalLM.*rope_scaling type 'dynamic' \(dynamic NTK\) "
                                         r"is not supported"):
        ModelRunner(Config.build({"model": {"path": path, "impl": impl}}), show_progress=False)


def test_the_safetensors_progress_bar_knows_its_total(tiny_llama_dir):
    """The audit saw "loading safetensors weights: 272tensor [00:17, ...]": a bar with no end."""
    from radixserve.model_loader.sources import iter_safetensors, open_source
    from radixserve.plugins.registry import Registry

    path = tiny_llama_dir("llama")
    source = open_source(path, "auto", Registry.discover(), None)
    assert source.num_tensors() == sum(1 for _ in iter_safetensors(path)) > 0


def test_a_mistake_found_in_the_scheduler_at_start_up_is_said_once_without_a_traceback(smollm2_gguf_path):
    """The audit's `serve --tp 2` on a 9-head model printed its (correct) message three times, with a
    traceback from the scheduler in two runs of three: the scheduler printed the traceback, the
    runtime logged the child's failure, and the server logged the failed start."""
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.run(
        [sys.executable, "-m", "radixserve.cli", "serve", "--model", smollm2_gguf_path, "--port", str(port),
         "model.context_length=100000", "runtime.num_threads=1"],
        capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out  # a bad config value: exit 2, as `generate` gives (audit28 finding 3)
    assert out.count("model.context_length=100000 is beyond") == 1, out
    assert "radixserve: error: model.context_length=100000 is beyond" in out, out
    assert "Traceback" not in out, out


def test_the_fallback_caps_a_chunked_attention_model_at_its_chunk(tiny_llama_dir, caplog):
    """Models audit 32: Llama 4's attention_chunk_size through the fallback gave wrong tokens past the chunk
    in silence (its masks are not read); the context is now capped at the chunk (Model.context_limit)."""
    path = tiny_llama_dir("llama", attention_chunk_size=64)
    with caplog.at_level("WARNING", logger="radixserve.model_runner"):
        runner = ModelRunner(Config.build({"model": {"path": path, "impl": "transformers"}}), show_progress=False)
    assert runner.context_len == 64 and "context capped at 64 tokens (of the 512" in caplog.text
    with pytest.raises(ValueError, match=r"model.context_length=128 is beyond what architecture LlamaForCausalLM: "
                                         r"transformers fallback .* computes exactly \(64: .*attention_chunk_size"):
        ModelRunner(Config.build({"model": {"path": path, "impl": "transformers", "context_length": 128}}),
                    show_progress=False)
    assert ModelRunner(Config.build({"model": {"path": path}}), show_progress=False).context_len == 512  # native: none
