"""The Engine's user-facing errors and exit: bad parameters are a ValueError naming the parameter,
json_schema may be a dict (as on /generate), async_generate's one-prompt and shut-down errors, and a
script that never calls shutdown() exits without a traceback."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys

import pytest
from radixserve.engine import Engine, engine_config

pytestmark = pytest.mark.slow

CPU = {"device": "cpu", "cuda_graph": False, "num_threads": 1}


@pytest.fixture(scope="module")
def engine():
    eng = Engine(scheduler={"max_total_tokens": 4096}, runtime=CPU)
    yield eng
    eng.shutdown()


@pytest.mark.parametrize(
    ("params", "kwargs", "named"),
    [
        ({"temperature": "hot"}, {}, "temperature"),
        ({"temperature": float("nan")}, {}, "temperature"),
        ({"max_new_tokens": 1.5}, {}, "max_new_tokens"),
        ({"seed": "x"}, {}, "seed"),
        ({"stop": 5}, {}, "stop"),
        ("max_new_tokens=4", {}, "sampling_params"),
        ({"max_new_tokens": 2}, {"top_logprobs_num": 50, "return_logprob": True}, "top_logprobs_num"),
        # engine audit 31: ignored without a word, where logprob_start_len without return_logprob was refused
        ({"max_new_tokens": 2}, {"top_logprobs_num": 2}, "top_logprobs_num requires return_logprob"),
        ({"max_new_tokens": 2}, {"return_logprob": "yes"}, "return_logprob must be true or false"),
    ],
)
def test_bad_sampling_values_are_value_errors_naming_the_parameter(engine, params, kwargs, named):
    with pytest.raises(ValueError, match=named):
        engine.generate("Hi", params, **kwargs)
    assert engine.is_healthy()


def test_a_prompt_that_is_not_text_is_a_value_error_naming_it(engine):
    with pytest.raises(ValueError, match="prompt must be a str"):
        engine.generate(123, {"max_new_tokens": 2})
    with pytest.raises(ValueError, match="input_ids must be"):
        engine.generate(input_ids=7, sampling_params={"max_new_tokens": 2})


@pytest.mark.parametrize("rid", [5, b"x", 2.5])
def test_a_rid_that_is_not_a_string_is_refused_not_lost(engine, rid):
    """A non-str rid was dropped by the scheduler process (its typed message needs a str) and the
    caller waited forever; now a 400 naming it, and abort() of such a rid is a no-op."""
    with pytest.raises(ValueError, match="rid must be a string") as e:
        engine.generate("Hi", {"max_new_tokens": 2}, rid=rid)
    assert getattr(e.value, "status", None) == 400 and e.value.param == "rid"
    with pytest.raises(ValueError, match="rid must be a string"):
        asyncio.run(asyncio.wait_for(engine.async_generate("Hi", {"max_new_tokens": 2}, rid=rid), 60))
    engine.abort(rid)
    assert engine.generate("Hi", {"max_new_tokens": 2})["meta_info"]["completion_tokens"] == 2
    assert engine.get_stats()["in_flight_requests"] == 0


def test_generate_samples_each_prompt_n_times_with_seed_plus_i(engine):
    """SGLang's Engine takes sampling_params.n (a list back, each prompt's samples together); it was refused here.
    Sample i runs with seed + i, as the HTTP routes' choice i: it equals the one-sample call with that seed."""
    sp = {"max_new_tokens": 6, "temperature": 1.0, "seed": 11, "ignore_eos": True}
    out = engine.generate(["Hi", "Once upon"], {**sp, "n": 3})
    assert isinstance(out, list) and len(out) == 6
    for k, prompt in enumerate(["Hi", "Once upon"]):
        for i in range(3):
            alone = engine.generate(prompt, {**sp, "seed": 11 + i})
            assert out[k * 3 + i]["output_ids"] == alone["output_ids"], (k, i)
    assert len({tuple(o["output_ids"]) for o in out[:3]}) > 1  # the copies differ
    one = engine.generate("Hi", {**sp, "n": 2}, rid="mine")
    assert [o["meta_info"]["id"] for o in one] == ["mine-0", "mine-1"]


def test_n_and_top_logprobs_that_would_be_ignored_are_refused(engine):
    """async_generate runs one sample: `n` there would be dropped; top_logprobs without logprobs is refused as on
    /generate; n beyond 128 and a seed whose last copy passes 64 bits are refused before anything runs."""
    with pytest.raises(ValueError, match="sampling_params.n: one completion per request"):
        asyncio.run(asyncio.wait_for(engine.async_generate("Hi", {"max_new_tokens": 2, "n": 2}), 60))
    with pytest.raises(ValueError, match=re.escape("sampling_params.n must be an integer in [1, 128], got 129")):
        engine.generate("Hi", {"max_new_tokens": 2, "n": 129})
    with pytest.raises(ValueError, match="sampling_params.seed must be a 64-bit integer"):
        engine.generate("Hi", {"max_new_tokens": 2, "n": 2, "seed": 2**63 - 1})
    with pytest.raises(ValueError, match="top_logprobs requires"):
        engine.generate("Hi", {"max_new_tokens": 2, "top_logprobs": 3})
    assert engine.get_stats()["in_flight_requests"] == 0


def test_n_in_a_batch_follows_generates_rules(engine):
    """Audit 37b: the Engine took per-prompt n values that differ (k * n + i then pointed at the wrong results) and
    any number of results (/generate caps a request at 1,024); a per-prompt list of the wrong length was a bare
    ValueError without .param."""
    with pytest.raises(ValueError, match=re.escape("sampling_params[1].n (1) differs from sampling_params[0].n (2)")) as e:
        engine.generate(["a", "b"], [{"max_new_tokens": 1, "n": 2}, {"max_new_tokens": 1}])
    assert e.value.param == "sampling_params[1].n"
    with pytest.raises(ValueError, match=r"at most 1024 completions in one request \(prompts times n; got 9 x 128\)"):
        engine.generate(["a"] * 9, {"max_new_tokens": 1, "n": 128})
    with pytest.raises(ValueError, match=r"^sampling_params: a list of 1 for 2 prompts") as e:
        engine.generate(["a", "b"], [{"max_new_tokens": 1}])
    assert e.value.param == "sampling_params"
    assert engine.get_stats()["in_flight_requests"] == 0


def test_a_sampling_params_object_gets_what_a_dict_gets(engine):
    """engine.md names radixserve.state.SamplingParams; an object with n=2 returned one completion (audit, session 27)."""
    from radixserve.state import SamplingParams

    assert len(engine.generate("Hi", SamplingParams(max_new_tokens=2, n=2))) == 2
    assert engine.generate("Hi", SamplingParams(max_new_tokens=2))["meta_info"]["completion_tokens"] == 2


def test_an_empty_input_ids_is_an_empty_prompt_not_an_empty_batch(engine):
    with pytest.raises(ValueError, match="input_ids: the prompt is empty") as e:
        engine.generate(input_ids=[], sampling_params={"max_new_tokens": 2})
    assert e.value.status == 400 and e.value.param == "input_ids"
    assert engine.generate([], {"max_new_tokens": 2}) == []  # a batch of no text prompts stays an empty batch


def test_prompt_and_constraint_errors_name_the_engines_own_arguments(engine):
    """An outside audit: `prompt=` errors named `text` (/generate's field), and a regex that did not
    compile said `regex: ...` where its param is sampling_params.regex."""
    with pytest.raises(ValueError, match=r"^prompt\[1\]: the prompt is empty") as e:
        engine.generate(["a", ""], {"max_new_tokens": 2})
    assert e.value.param == "prompt[1]"  # a batch's prompt by its index, as the HTTP routes' prompt[1]
    with pytest.raises(ValueError, match=r"^input_ids\[1\]\[0\] token id 60000 is out of range") as e:
        engine.generate(input_ids=[[504, 3575], [60000]], sampling_params={"max_new_tokens": 2})
    assert e.value.param == "input_ids[1]"  # audit 30: "input_ids[0] token id 60000" read as prompt 0
    with pytest.raises(ValueError, match=r"^input_ids\[0\] token id 60000 is out of range"):
        engine.generate(input_ids=[60000], sampling_params={"max_new_tokens": 2})  # one prompt: its id 0
    with pytest.raises(ValueError, match="^the prompt has") as e:
        engine.generate("hi " * engine.tokenizer_manager.context_len, {"max_new_tokens": 2})
    assert e.value.param == "prompt" and e.value.code == "context_length_exceeded"
    with pytest.raises(ValueError, match="^sampling_params.regex: invalid regex") as e:
        engine.generate("x", {"regex": "(a", "max_new_tokens": 2})
    assert e.value.param == "sampling_params.regex"
    # audit 34: in a batch, the runtime's refusal names the prompt's place as the checks before sending do
    with pytest.raises(ValueError, match=r"^sampling_params\[1\]\.regex: invalid regex") as e:
        engine.generate(["x", "y"], [{"max_new_tokens": 2}, {"regex": "(a", "max_new_tokens": 2}])
    assert e.value.param == "sampling_params[1].regex"
    assert engine.generate("Hi", {"max_new_tokens": 2, "top_p": 0})["meta_info"]["completion_tokens"] == 2


LONG = {"max_new_tokens": 64, "ignore_eos": True}


@pytest.mark.parametrize(
    ("prompts", "params", "checked_here"),
    [(["hi", ""], {"max_new_tokens": 8}, True),                      # an empty prompt second
     (["", "hi"], {"max_new_tokens": 8}, True),                      # ... and first
     (["hi", "hello " * 9000], {"max_new_tokens": 8}, True),         # one over the context
     (["hi", "hello " * 5000], LONG, False),                         # over the 4096-slot pool: the scheduler's
     (["hi", "yo"], [LONG, {"max_new_tokens": 8, "regex": "("}], False)],  # the grammar's
)
def test_a_batch_with_one_bad_prompt_runs_none_of_it(engine, prompts, params, checked_here):
    """Audit 30: the batch raised as documented, but its good prompts still ran to completion unseen."""
    import time

    from radixserve.errors import RequestError

    engine.generate("x", {"regex": "a", "max_new_tokens": 1})  # the grammar backend's first start is not timed
    before = engine.get_stats()
    with pytest.raises((ValueError, RequestError)):
        engine.generate(prompts, params)
    time.sleep(0.5)  # a request the call left behind would be decoding by now
    after = engine.get_stats()
    assert after["in_flight_requests"] == 0, after
    if checked_here:  # refused in this process: nothing reached the scheduler
        assert after["generated_tokens"] == before["generated_tokens"], (before, after)
        assert after["finished_requests"] == before["finished_requests"], (before, after)
    else:  # refused by the scheduler: the other prompt is aborted, not run to its end
        assert after["generated_tokens"] - before["generated_tokens"] < LONG["max_new_tokens"], (before, after)


def test_config_may_be_a_dict_of_the_yaml_content_and_anything_else_is_named():
    assert engine_config(None, {"stack": {"policy": "lpm"}}, None, {}).stack.policy == "lpm"
    with pytest.raises(ValueError, match="config= takes a YAML file's path, a Config or a dict.*int 5"):
        engine_config(None, 5, None, {})


def test_ctrl_c_in_a_blocking_generate_aborts_its_requests(engine):
    """A KeyboardInterrupt (or any exception) in the caller's thread while generate() waits used to leave the
    requests running in the scheduler, with ids the caller never saw (audit, session 27)."""
    import signal
    import threading
    import time

    # a real SIGINT (as Ctrl-C sends): it wakes the main thread blocked in the wait; interrupt_main would not
    threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT)).start()
    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        engine.generate(["Tell me a long story"] * 4, {"max_new_tokens": 3000, "ignore_eos": True})
    assert time.monotonic() - started < 20  # raised while waiting, not after 12,000 tokens
    deadline = time.monotonic() + 30
    while engine.get_stats()["in_flight_requests"] and time.monotonic() < deadline:
        time.sleep(0.2)
    stats = engine.get_stats()
    assert stats["in_flight_requests"] == 0 and stats["running"] == 0, stats
    assert engine.generate("Hi", {"max_new_tokens": 2})["meta_info"]["completion_tokens"] == 2


def test_a_section_that_is_not_a_dict_names_the_section():
    with pytest.raises(ValueError, match="stack= must be a dict"):
        engine_config(None, None, None, {"stack": "lpm"})


def test_json_schema_may_be_a_dict_as_on_http_generate(engine):
    out = engine.generate("How many legs has a cat?", {"json_schema": {"type": "integer"}, "max_new_tokens": 6,
                                                      "temperature": 0})
    assert out["text"].strip().lstrip("-").isdigit(), out["text"]


def test_async_generate_takes_one_prompt(engine):
    with pytest.raises(ValueError, match="async_generate takes one prompt"):
        asyncio.run(engine.async_generate(["a", "b"], {"max_new_tokens": 2}))
    with pytest.raises(ValueError, match="async_generate takes one prompt"):
        asyncio.run(engine.async_generate(input_ids=[[1, 2], [3]], sampling_params={"max_new_tokens": 2}))
    out = asyncio.run(engine.async_generate("Hi", {"max_new_tokens": 2}))
    assert out["meta_info"]["completion_tokens"] == 2


def test_zz_async_generate_after_shutdown_says_the_engine_was_shut_down(engine):
    engine.shutdown()
    with pytest.raises(RuntimeError, match="the engine was shut down"):
        asyncio.run(engine.async_generate("Hi", {"max_new_tokens": 2}))
    with pytest.raises(RuntimeError, match="the engine was shut down"):
        engine.generate("Hi", {"max_new_tokens": 2})


def test_a_bad_entry_of_a_per_prompt_sampling_list_names_its_place(engine):
    """Engine audit 31: `sampling_params.temperature` did not say which of the batch's dicts was bad."""
    with pytest.raises(ValueError, match=r"sampling_params\[1\]\.temperature must be") as e:
        engine.generate(["a", "b"], [{"max_new_tokens": 2}, {"temperature": -3}])
    assert e.value.param == "sampling_params[1].temperature"
    with pytest.raises(ValueError, match=r"rid: a batch of 2 prompts takes a list of 2 distinct rids, got one str"):
        engine.generate(["a", "b"], {"max_new_tokens": 2}, rid="x")


FORKS = """
import os, sys
from radixserve import Engine
e = Engine(runtime={cpu!r})
pid = os.fork()
if pid == 0:  # the child: what it may do, then the normal exit path (atexit runs shutdown)
    print("child healthy", e.is_healthy(), flush=True)
    try:
        e.generate("Hi", {{"max_new_tokens": 2}})
    except RuntimeError as err:
        print("child refused:", err, flush=True)
    e.shutdown()  # a no-op here: the runtime is the parent's
    sys.exit(0)
_, status = os.waitpid(pid, 0)
print("child exit", os.waitstatus_to_exitcode(status), flush=True)
print("parent", e.is_healthy(), e.generate("Hi", {{"max_new_tokens": 2}})["meta_info"]["completion_tokens"])
print("owner", os.getpid())
"""


def test_a_forked_child_cannot_use_the_engine_and_exits_without_waiting_on_it(tmp_path):
    """Engine audit 31: in a fork every call (and the exit-time shutdown) waited forever on the loop thread the fork
    did not copy, while is_healthy() said True."""
    script = tmp_path / "forks.py"
    script.write_text(FORKS.format(cpu=CPU))
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-4000:]
    owner = re.search(r"owner (\d+)", run.stdout).group(1)
    assert "child healthy False" in run.stdout, run.stdout
    assert f"child refused: this Engine belongs to process {owner}" in run.stdout, run.stdout
    assert "child exit 0" in run.stdout and "parent True 2" in run.stdout, run.stdout


def test_a_system_exit_while_the_engine_starts_is_a_runtime_error_not_a_hang(tmp_path):
    """Engine audit 31: a module calling sys.exit during start-up (here a tokenizers.py beside the script) ended the
    engine's loop thread, and Engine() waited forever with no output."""
    (tmp_path / "tokenizers.py").write_text("raise SystemExit('not the real tokenizers')\n")
    script = tmp_path / "start.py"
    script.write_text(
        "from radixserve import Engine\n"
        "try:\n"
        f"    Engine(runtime={CPU!r})\n"
        "except RuntimeError as e:\n"
        "    print('refused:', e)\n"
    )
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-4000:]
    assert "refused: SystemExit('not the real tokenizers') inside the engine's event loop" in run.stdout, run.stdout


def test_a_script_that_never_shuts_down_exits_without_a_traceback(tmp_path):
    """shutdown() also runs at interpreter exit: there the default executor is already gone."""
    script = tmp_path / "no_shutdown.py"
    script.write_text(
        "from radixserve import Engine\n"
        f"e = Engine(runtime={CPU!r})\n"
        'print(e.generate("Hi", {"max_new_tokens": 4})["text"])\n'
    )
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600, cwd=tmp_path,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-4000:]
    for bad in ("Traceback", "Exception ignored", "Task was destroyed"):
        assert bad not in run.stderr, run.stderr[-4000:]


def test_a_checkpoint_without_a_tokenizer_is_said_before_anything_starts(tmp_path):
    """A tiny checkpoint with no tokenizer file gave transformers' 'install sentencepiece or tiktoken' after the
    model and its KV pool loaded (a plugin author's audit, session 27): now the missing tokenizer, at once."""
    import time

    from radixserve.testing import tiny_checkpoint

    ckpt = tiny_checkpoint("llama", str(tmp_path / "tiny"))
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="no tokenizer in .*tiny.*model.tokenizer"):
        Engine(model=ckpt, runtime=CPU)
    assert time.monotonic() - started < 10


def test_a_bad_value_found_by_the_model_process_is_the_documented_config_error(smollm2_gguf_path):
    """Audit 30: model.context_length past the model's positions is refused in the scheduler process,
    and the Engine raised it as ChildStartError (a RuntimeError) where engine.md documents ConfigError."""
    from radixserve.config import ConfigError

    with pytest.raises(ConfigError, match=r"model.context_length=1000000 is beyond what this model's positions cover"):
        Engine({"path": smollm2_gguf_path, "context_length": 1_000_000}, runtime=CPU)


@pytest.mark.parametrize(("impl", "disable", "said"), [
    ("native", [], "no native model plugin claims architecture 'LlamaForCausalLMM'"),
    ("auto", ["transformers"], "the transformers fallback, which is installed but not loaded"),
])
def test_a_model_no_implementation_runs_is_refused_before_any_process_starts(tmp_path, impl, disable, said):
    """Audit 30: config.json's architecture against model.impl was checked in the scheduler process, so the
    PluginError came after the processes started (17-27 s, a child's traceback on stderr first)."""
    import time

    from radixserve.plugins.registry import PluginError
    from radixserve.testing import tiny_checkpoint

    ckpt = tiny_checkpoint("llama", str(tmp_path / "tiny"))
    config_file = tmp_path / "tiny" / "config.json"
    config_file.write_text(config_file.read_text().replace('"LlamaForCausalLM"', '"LlamaForCausalLMM"'))
    started = time.monotonic()
    with pytest.raises(PluginError, match=re.escape(said)):
        Engine({"path": ckpt, "impl": impl}, runtime=CPU, plugins={"disable": disable})
    assert time.monotonic() - started < 5
