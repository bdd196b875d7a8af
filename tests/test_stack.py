"""The stack is resolved and checked before any model loads, in every entry point (serve, generate,
Engine, the model runner the scheduler process builds), against the registry built from the config."""

from __future__ import annotations

import json
import os
import time

import pytest
from plugin_fixtures import make_fake_distribution, run_cli
from radixserve.config import Config
from radixserve.interfaces import Drafter, DraftProposal, SchedulePolicy
from radixserve.plugins.registry import PluginError, Registry
from radixserve.plugins.stack import check_quantization_fits, resolve_stack

MISSING_MODEL = "/nonexistent/models/SmolLM2-135M-Instruct.Q4_1.gguf"


def _stack_file(tmp_path, text: str) -> str:
    f = tmp_path / "stack.yaml"
    f.write_text(text)
    return str(f)


# ---- fail fast: a bad stack is reported before the model is looked at -------------------------
@pytest.mark.parametrize("command", ["serve", "generate"])
def test_cli_unknown_policy_fails_before_loading(tmp_path, command):
    stack = _stack_file(tmp_path, "stack:\n  policy: lpm-typo\n")
    args = [command, "--config", stack, "--model", MISSING_MODEL] + (["hello"] if command == "generate" else [])
    start = time.monotonic()
    r = run_cli(args)
    assert r.returncode == 2, r.stderr
    assert "lpm-typo" in r.stderr and "fcfs" in r.stderr, r.stderr  # the bad value and the valid choices
    assert "does not exist" not in r.stderr and "Traceback" not in r.stderr
    assert time.monotonic() - start < 60


def test_engine_unknown_policy_fails_before_loading(tmp_path):
    from radixserve.engine import Engine

    with pytest.raises(PluginError, match="lpm-typo.*installed policy components: .*fcfs"):
        Engine(model=MISSING_MODEL, config=_stack_file(tmp_path, "stack:\n  policy: lpm-typo\n"))


def test_serve_honours_plugins_disable_from_the_stack_file(tmp_path):
    stack = _stack_file(tmp_path, "stack:\n  prefix_cache: chunk\nplugins:\n  disable: [chunk]\n")
    r = run_cli(["serve", "--config", stack, "--model", MISSING_MODEL])
    assert r.returncode == 2
    assert "no prefix_cache component named 'chunk'" in r.stderr and "radixserve-cache-chunk" in r.stderr, r.stderr


@pytest.mark.parametrize("command", [["generate", "hello"], ["bench", "one-batch"]])
def test_deny_flag_works_on_generate_and_bench(tmp_path, command):
    # `-p no:NAME` is documented for every command (plugin-authoring.md); generate used to swallow
    # the prompt into "unrecognized arguments"
    args = [*command, "-p", "no:chunk", "--model", MISSING_MODEL, "stack.prefix_cache=chunk"]
    r = run_cli(args)
    assert r.returncode == 2, r.stderr
    assert "no prefix_cache component named 'chunk'" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_generate_says_the_scheduler_keys_it_cannot_use():
    """`generate` runs one request without the scheduler: a policy or prefix cache set in the stack is checked
    (as above) and then named in a note, not silently ignored (a plugin author's audit, session 27)."""
    r = run_cli(["generate", "--max-tokens", "1", "--no-chat", "Hi", "stack.policy=lpm",
                 "stack.policy_options={fcfs_threshold: 8}"])
    assert r.returncode == 0, r.stderr
    assert "note: stack.policy, stack.policy_options not used: generate runs one request" in r.stderr, r.stderr
    assert "radixserve serve" in r.stderr
    quiet = run_cli(["generate", "--max-tokens", "1", "--no-chat", "Hi"])
    assert quiet.returncode == 0 and "note:" not in quiet.stderr, quiet.stderr


def test_config_show_names_the_quantization_a_checkpoint_declares(tmp_path):
    """`config show --model DIR` said `quantization: null` for a checkpoint whose config.json declares a method,
    even one no installed plugin provides (a plugin author's audit, session 27): now the method and where its
    name came from, or, as at start-up, the error naming config.json."""
    from radixserve.testing import tiny_checkpoint

    ckpt = tiny_checkpoint("llama", str(tmp_path / "tiny"))
    plain = run_cli(["config", "show", "--model", ckpt])
    assert plain.returncode == 0, plain.stderr
    assert "  quantization: unquantized  # the default;" in plain.stdout, plain.stdout
    cfg = tmp_path / "tiny" / "config.json"
    cfg.write_text(json.dumps({**json.loads(cfg.read_text()), "quantization_config": {"quant_method": "int8pc"}}))
    r = run_cli(["config", "show", "--model", ckpt])
    assert r.returncode == 2 and "Traceback" not in r.stderr and "resolved_stack" not in r.stdout, r.stderr
    assert "quantization_config.quant_method (config.json) is 'int8pc'" in r.stderr, r.stderr
    assert "installed quantization components:" in r.stderr


def test_generate_refuses_parallel_sizes_by_name():
    r = run_cli(["generate", "hello", "--model", MISSING_MODEL, "runtime.tp_size=2"])
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "runtime.tp_size=2" in r.stderr and "serve --tp" in r.stderr and "TPGroup" not in r.stderr, r.stderr


def test_unknown_drafter_is_a_clear_startup_error(tmp_path):
    r = run_cli(["config", "show", "stack.speculative=no-such-drafter"])
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "no drafter component named 'no-such-drafter'" in r.stderr, r.stderr
    with pytest.raises(PluginError, match="no drafter component named 'no-such-drafter'.*oracle"):
        resolve_stack(Config.build({"stack": {"speculative": "no-such-drafter"}}), Registry.discover(), "cpu")


def test_drafter_resolves_and_its_options_are_checked():
    reg = Registry.discover()
    stack = resolve_stack(Config.build({"stack": {"speculative": "oracle"}}), reg, "cpu")
    assert stack.drafter is not None and stack.drafter.name == "oracle"
    bad = Config.build({"stack": {"speculative": "oracle"}, "speculative": {"options": {"no_such": 1}}})
    with pytest.raises(PluginError, match="speculative.options: drafter 'oracle' has no option 'no_such'"):
        resolve_stack(bad, reg, "cpu")


def test_component_that_does_not_support_the_device_is_an_error():
    reg = Registry.discover()
    cpu_only = [s.name for s in reg.components("attention") if not s.supports_device("cuda")]
    assert cpu_only, "an installed CPU-only attention backend is needed for this test"
    with pytest.raises(PluginError, match=f"stack.attention='{cpu_only[0]}'.*does not support device 'cuda'"):
        resolve_stack(Config.build({"stack": {"attention": cpu_only[0]}}), reg, "cuda")


# ---- policy options ---------------------------------------------------------------------------
def test_policy_options_reach_the_policy_constructor():
    from radixserve.scheduler import Scheduler
    from radixserve.testing import ToyRunner

    config = Config.build({"stack": {"policy": "lpm", "policy_options": {"fcfs_threshold": 3}}})
    reg = Registry.discover()
    assert resolve_stack(config, reg, "cpu").policy_options == {"fcfs_threshold": 3}
    sched = Scheduler.from_config(config, ToyRunner(vocab_size=100), reg)
    assert sched.policy.fcfs_threshold == 3


def test_unknown_or_bad_policy_option_lists_the_valid_ones():
    reg = Registry.discover()
    with pytest.raises(PluginError, match="policy 'lpm' has no option 'threshold'; valid options: fcfs_threshold"):
        resolve_stack(Config.build({"stack": {"policy": "lpm", "policy_options": {"threshold": 3}}}), reg, "cpu")
    with pytest.raises(PluginError, match="policy 'fcfs' has no option 'seed'; it takes no options"):
        resolve_stack(Config.build({"stack": {"policy_options": {"seed": 1}}}), reg, "cpu")
    with pytest.raises(PluginError, match="fcfs_threshold must be >= 0"):
        resolve_stack(Config.build({"stack": {"policy": "lpm", "policy_options": {"fcfs_threshold": -1}}}), reg, "cpu")


def test_priority_policy_admits_the_higher_priority_request_first():
    from radixserve.runtime.messages import GenerateRequest
    from radixserve.scheduler import Scheduler
    from radixserve.state import SamplingParams
    from radixserve.testing import ToyRunner

    config = Config.build({"stack": {"policy": "priority"}, "scheduler": {"max_running_requests": 1}})
    sched = Scheduler.from_config(config, ToyRunner(vocab_size=100), Registry.discover())
    for rid, prio in (("low", 0), ("high", 5)):
        sched.add_request(GenerateRequest(rid=rid, input_ids=[1, 2, 3], sampling_params=SamplingParams(max_new_tokens=2),
                                          priority=prio))
    order: list[str] = []
    for _ in range(100):
        order += [o.rid for o in sched.step() if o.new_ids and o.rid not in order]
    assert order == ["high", "low"]


def test_engine_generate_carries_priority():
    from radixserve.engine import Engine

    inputs, _ = Engine._inputs(None, [[1, 2], [3]], None, None, False, False, 0, [4, -1])
    assert [i.priority for i in inputs] == [4, -1]
    with pytest.raises(ValueError, match="priority"):
        Engine._inputs("hi", None, None, None, False, False, 0, "high")


@pytest.mark.parametrize("prio", [2**31, -(2**31) - 1, 2**63, 10**30, -(10**30)])
def test_engine_priority_has_the_http_routes_range(prio):
    """Audit 30: the Engine took 2**63 (HTTP: a 400 above 2**31 - 1) and raised a bare OverflowError
    from the message encoder for 10**30."""
    from radixserve.engine import Engine
    from radixserve.validation import InvalidRequest

    with pytest.raises(InvalidRequest, match=r"priority must be in \[-2147483648, 2147483647\]") as e:
        Engine._inputs("hi", None, None, None, False, False, 0, prio)
    assert e.value.param == "priority"
    inputs, _ = Engine._inputs(None, [[1], [2]], None, None, False, False, 0, [2**31 - 1, -(2**31)])
    assert [i.priority for i in inputs] == [2**31 - 1, -(2**31)]


# ---- quantization vs the checkpoint ----------------------------------------------------------
def test_quantization_for_a_gguf_file_must_be_its_weight_source(smollm2_gguf_path):
    from radixserve.model_runner import ModelRunner

    config = Config.build({"model": {"path": smollm2_gguf_path}, "stack": {"quantization": "unquantized"},
                           "runtime": {"device": "cpu"}})
    with pytest.raises(PluginError, match="stack.quantization='unquantized'.*weight source 'gguf'"):
        ModelRunner(config, Registry.from_config(config), show_progress=False)


def test_weight_source_on_an_hf_directory_is_an_error(tiny_llama_dir):
    from radixserve.model_runner import ModelRunner

    path = tiny_llama_dir("llama")
    config = Config.build({"model": {"path": path}, "stack": {"quantization": "gguf"}, "runtime": {"device": "cpu"}})
    with pytest.raises(PluginError, match=f"stack.quantization='gguf' reads .gguf files, but '{path}'"):
        ModelRunner(config, Registry.from_config(config), show_progress=False)


def test_quantization_conflicting_with_the_checkpoint_declaration(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "fp8"}}))
    reg = Registry.discover()
    stack = resolve_stack(Config.build({"stack": {"quantization": "unquantized"}}), reg, "cpu")
    with pytest.raises(PluginError, match="'unquantized'.*quant_method='fp8'"):
        check_quantization_fits(stack, str(tmp_path), reg)


# ---- the scheduler process builds its own registry from the same config -----------------------
BROKEN_PLUGIN = """
raise ImportError("this plugin must never be imported: the stack disables it")
"""


@pytest.mark.slow
def test_plugins_disable_reaches_the_scheduler_process(tmp_path, monkeypatch, smollm2_gguf_path):
    """A plugin the stack disables is not loaded by any process: importing this one fails, so an
    Engine starts only if the scheduler process honours plugins.disable too."""
    from radixserve.engine import Engine

    site = tmp_path / "site"
    site.mkdir()
    make_fake_distribution(site, "radixserve-broken", "broken", "rs_broken_plugin", BROKEN_PLUGIN)
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]))
    with pytest.raises(PluginError, match="radixserve-broken"):
        Registry.discover()  # the plugin is visible to discovery
    stack = _stack_file(tmp_path, "plugins:\n  disable: [broken]\n")
    with Engine(model=smollm2_gguf_path, config=stack, runtime={"device": "cpu", "cuda_graph": False,
                                                                  "num_threads": 1},
                scheduler={"max_total_tokens": 1024}) as eng:
        out = eng.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 2, "temperature": 0})
    assert out["meta_info"]["completion_tokens"] == 2


@pytest.mark.parametrize("dp", [None, "2"])
def test_serve_on_a_busy_port_fails_before_loading(dp):
    # the port is bound first: a busy one is reported at once (it used to surface as uvicorn's
    # "[Errno 98]" only after the model had loaded and the kernels compiled)
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = run_cli(["serve", "--model", MISSING_MODEL, "--port", str(port), *(["--dp", dp] if dp else [])])
    assert r.returncode == 2, r.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in r.stderr and "--port" in r.stderr, r.stderr
    assert "does not exist" not in r.stderr and "Traceback" not in r.stderr, r.stderr


# ---- audit 37: a component's class and constructor, checked and reported one way ----------------
class _AbstractPolicy(SchedulePolicy):
    def ordr(self, waiting, cache):  # `order` misspelled
        return waiting


class _InitTypeErrorPolicy(SchedulePolicy):
    def __init__(self, *, max_wait_s=1.0):
        super().__init__()
        self.max_wait_s = float(max_wait_s) + "x"  # a bug, not a refused option

    def order(self, waiting, cache):
        return waiting


class _InitKeyErrorPolicy(SchedulePolicy):
    def __init__(self):
        super().__init__()
        self.v = {}["missing"]

    def order(self, waiting, cache):
        return waiting


class _RefusingPolicy(SchedulePolicy):
    def __init__(self, *, bucket=1):
        super().__init__()
        if bucket < 1:
            raise ValueError(f"stack.policy_options.bucket must be >= 1, got {bucket}")

    def order(self, waiting, cache):
        return waiting


class _AbstractDrafter(Drafter):
    def propse(self, reqs, num_draft_tokens):  # `propose` misspelled
        return DraftProposal([[] for _ in reqs])


class _NoInfoDrafter(Drafter):
    def __init__(self, k=2):  # forgot the info
        self.k = k

    def propose(self, reqs, num_draft_tokens):
        return DraftProposal([[] for _ in reqs])


class _InitKeyErrorDrafter(Drafter):
    def __init__(self, info, *, table="x"):
        super().__init__(info)
        self.v = {}[table]

    def propose(self, reqs, num_draft_tokens):
        return DraftProposal([[] for _ in reqs])


_BUGGY = {"policy": ["_AbstractPolicy", "_InitTypeErrorPolicy", "_InitKeyErrorPolicy", "_RefusingPolicy"],
          "drafter": ["_AbstractDrafter", "_NoInfoDrafter", "_InitKeyErrorDrafter"]}


@pytest.fixture(scope="module")
def buggy_registry() -> Registry:
    """The installed components plus this module's broken ones, registered by 'radixserve-buggy 0.1.0'."""
    import types

    def register(registry):
        for kind, classes in _BUGGY.items():
            for cls in classes:
                registry.register(kind, cls.strip("_"), f"{__name__}:{cls}")

    mod = types.ModuleType("buggy")
    mod.PLUGIN_API, mod.radixserve_register = ">=1,<2", register
    reg = Registry.discover()
    reg.add_plugin_module(mod, name="buggy", distribution="radixserve-buggy", version="0.1.0")
    return reg


def _resolve(reg, **stack):
    return resolve_stack(Config.build({"stack": stack}), reg, "cpu")


def test_an_abstract_policy_or_drafter_is_refused_at_resolution_naming_the_method(buggy_registry):
    """Audit 37 (D4, D9): the policy's was reported as a policy_options problem; the drafter's passed `config show`
    and failed only after the model loaded and warmed up, as "the drafter refused its configuration"."""
    with pytest.raises(PluginError, match=r"^policy 'AbstractPolicy' \(radixserve-buggy 0.1.0\) does not implement "
                                          r"order\(\) \(test_stack._AbstractPolicy leaves it abstract"):
        _resolve(buggy_registry, policy="AbstractPolicy")
    with pytest.raises(PluginError, match=r"^drafter 'AbstractDrafter' \(radixserve-buggy 0.1.0\) does not implement "
                                          r"propose\(\)"):
        _resolve(buggy_registry, speculative="AbstractDrafter")


def test_a_drafter_without_the_info_parameter_is_refused_at_resolution(buggy_registry):
    """Audit 37 (D6): `__init__(self, k=2)` served, the info landing in k; `speculative.options.k` was then said to be
    an option it does not have."""
    with pytest.raises(PluginError, match=r"^drafter 'NoInfoDrafter' \(radixserve-buggy 0.1.0\) does not take the "
                                          r"DrafterInfo first: .*__init__\(self, k=2\) takes no `info` \(the info would "
                                          r"land in 'k'\)"):
        _resolve(buggy_registry, speculative="NoInfoDrafter")


@pytest.mark.parametrize("name, options, error", [
    ("InitTypeErrorPolicy", {}, "TypeError: unsupported operand type(s) for +: 'float' and 'str'"),
    ("InitKeyErrorPolicy", {}, "KeyError: 'missing'"),
])
def test_a_policy_constructor_bug_is_one_error_naming_the_policy_and_keeping_the_traceback(buggy_registry, name,
                                                                                            options, error):
    """Audit 37 (D4): a TypeError was blamed on stack.policy_options (none were set) without its traceback; a KeyError
    escaped bare (a traceback from the CLI, a bare KeyError from the Engine)."""
    from radixserve.plugins.registry import PluginCodeError

    with pytest.raises(PluginCodeError) as e:
        _resolve(buggy_registry, policy=name, policy_options=options)
    assert str(e.value) == f"policy {name!r} (radixserve-buggy 0.1.0) failed to build: {error}"
    assert "policy_options" not in str(e.value) and e.value.__cause__ is not None


def test_a_policy_refusing_a_value_is_still_an_options_error(buggy_registry):
    from radixserve.plugins.registry import PluginCodeError

    with pytest.raises(PluginError, match=r"^stack.policy_options for policy 'RefusingPolicy': "
                                          r"stack.policy_options.bucket must be >= 1, got 0$") as e:
        _resolve(buggy_registry, policy="RefusingPolicy", policy_options={"bucket": 0})
    assert not isinstance(e.value, PluginCodeError) and e.value.__cause__ is None
    assert _resolve(buggy_registry, policy="RefusingPolicy", policy_options={"bucket": 2}).policy.name == "RefusingPolicy"
    # a TypeError with options given may be the constructor refusing a value's type (the in-tree policies do, and the
    # Drafter contract asks it of an unknown option): said as the options' refusal, its traceback kept as the cause
    with pytest.raises(PluginError, match=r"^stack.policy_options for policy 'InitTypeErrorPolicy': unsupported "
                                          r"operand") as e:
        _resolve(buggy_registry, policy="InitTypeErrorPolicy", policy_options={"max_wait_s": 3})
    assert not isinstance(e.value, PluginCodeError) and isinstance(e.value.__cause__, TypeError)


def test_build_component_says_a_drafter_constructor_bug_as_one_line(buggy_registry):
    """The helper for every component constructor (the scheduler process builds the drafter: audit 37 saw
    "the scheduler process failed: KeyError('x')" after the model loaded)."""
    from radixserve.plugins.registry import PluginCodeError, build_component
    from radixserve.testing import drafter_info

    spec = buggy_registry.get("drafter", "InitKeyErrorDrafter")
    cls = buggy_registry.load("drafter", "InitKeyErrorDrafter")
    refused = "stack.speculative='InitKeyErrorDrafter': the drafter refused its configuration"
    with pytest.raises(PluginCodeError, match=r"^drafter 'InitKeyErrorDrafter' \(radixserve-buggy 0.1.0\) failed to "
                                              r"build: KeyError: 'x'$"):
        build_component(spec, cls, drafter_info(), refused=refused)
    with pytest.raises(PluginError, match=r"refused its configuration: .*unexpected keyword argument 'nope'"):
        build_component(spec, cls, drafter_info(), refused=refused, nope=1)  # an option it does not take


def test_the_scheduler_builds_its_drafter_through_build_component(buggy_registry):
    """The scheduler process's build_drafter: a drafter constructor's own bug names the drafter and its distribution
    (it was "the scheduler process failed: KeyError('x')" after the model loaded), an option it refuses stays the
    user's PluginError."""
    from types import SimpleNamespace

    from radixserve.config import Config
    from radixserve.plugins.registry import PluginCodeError
    from radixserve.scheduler.speculative.setup import build_drafter

    runner = SimpleNamespace(device="cpu", vocab_size=64)
    config = Config.build({"stack": {"speculative": "InitKeyErrorDrafter"}})
    with pytest.raises(PluginCodeError, match=r"^drafter 'InitKeyErrorDrafter' \(radixserve-buggy 0.1.0\) failed to "
                                              r"build: KeyError: 'x'$"):
        build_drafter(config, runner, buggy_registry)


def test_config_show_refuses_an_abstract_drafter_before_any_model_loads(tmp_path):
    """Audit 37 (D9), through a real entry point: exit 2, one line, no traceback."""
    body = '''
from radixserve.plugins import hookimpl
PLUGIN_API = ">=1.1,<2"

@hookimpl
def radixserve_register(registry):
    registry.register("drafter", "d-abstract", "rs_buggy_comps:AbstractDrafter")
'''
    (tmp_path / "rs_buggy_comps.py").write_text(
        "from radixserve.interfaces import Drafter, DraftProposal\n\n"
        "class AbstractDrafter(Drafter):\n"
        "    def propse(self, reqs, num_draft_tokens):\n"
        "        return DraftProposal([[] for _ in reqs])\n")
    make_fake_distribution(tmp_path, "radixserve-buggy", "buggy", "rs_buggy", body, version="0.1.0")
    r = run_cli(["config", "show", "stack.speculative=d-abstract"], site=tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert ("radixserve: error: drafter 'd-abstract' (radixserve-buggy 0.1.0) does not implement propose() "
            "(rs_buggy_comps.AbstractDrafter leaves it abstract; Drafter requires it)") in r.stderr
