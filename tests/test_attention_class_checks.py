"""An attention backend class the runner could not build or run (abstract, no `__init__(runner_info)`, a
`supports()` refusing the run's device, dtype or head size) is refused when the stack is resolved, before
any weights load, in every entry point, as one line (audit 28: it failed after the load, with a traceback
in `generate`, and `config show` accepted it)."""

from __future__ import annotations

import re

import pytest
from plugin_fixtures import make_fake_distribution, run_cli
from radixserve.config import Config
from radixserve.errors import traceback_worth_showing
from radixserve.interfaces import AttentionBackend
from radixserve.plugins.attention_class import attention_class_problem, check_attention_class
from radixserve.plugins.registry import PluginError, Registry
from radixserve_attention_torch_native.backend import TorchNativeBackend

MISSING_MODEL = "/nonexistent/models/tiny"

BROKEN_ATTENTION = """
from radixserve.interfaces import AttentionBackend
from radixserve.plugins import hookimpl
from radixserve_attention_torch_native.backend import TorchNativeBackend

PLUGIN_API = ">=1,<2"


class NoDecode(AttentionBackend):
    def __init__(self, runner_info):
        self.info = runner_info

    def init_forward_metadata(self, batch):
        pass

    def forward_extend(self, q, k, v, layer, batch):
        raise AssertionError("never called")


class NoInit(NoDecode):
    __init__ = object.__init__

    def forward_decode(self, q, k, v, layer, batch):
        raise AssertionError("never called")


class Refuses16(TorchNativeBackend):
    @classmethod
    def supports(cls, device, dtype, head_dim):
        return head_dim != 16  # the tiny checkpoints' head size


class NoCap(TorchNativeBackend):
    supports_sliding_window = True  # torch_native's own windows; no soft-capping
    supports_logit_cap = False


class Refuses64(TorchNativeBackend):
    @classmethod
    def supports(cls, device, dtype, head_dim):
        return head_dim != 64  # the default model's (SmolLM2) head size


@hookimpl
def radixserve_register(registry):
    for name, cls in (("nodecode", "NoDecode"), ("noinit", "NoInit"), ("refuses16", "Refuses16"),
                      ("refuses64", "Refuses64"), ("nocap", "NoCap")):
        registry.register("attention", name, f"rs_broken_attention:{cls}", devices=("cpu",), priority=-100)
"""
PROBLEMS = {"nodecode": "is abstract: it does not implement forward_decode",
            "noinit": r"defines no __init__\(runner_info\)", "refuses16": "does not support cpu/float32/head_dim=16",
            "refuses64": "does not support cpu/float32/head_dim=64"}


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    path = tmp_path_factory.mktemp("broken-attention-site")
    make_fake_distribution(path, "radixserve-broken-attention", "broken_attention", "rs_broken_attention",
                           BROKEN_ATTENTION)
    return path


@pytest.fixture
def on_path(site, monkeypatch):
    monkeypatch.syspath_prepend(str(site))
    return site


def test_what_makes_a_class_unusable_is_named():
    class Good(TorchNativeBackend):
        pass

    class LatentOnly(AttentionBackend):  # no standard methods needed
        supports_latent_attention, supports_standard_attention = True, False

        def __init__(self, runner_info=None, *, extra=1):
            pass

        def init_forward_metadata(self, batch):
            pass

    class InitWithoutInfo(Good):
        def __init__(self):
            pass

    class InitWithRequiredKeyword(Good):
        def __init__(self, runner_info, *, tile):
            pass

    assert attention_class_problem(Good) is None and attention_class_problem(LatentOnly) is None
    assert "not a subclass" in attention_class_problem(object)
    assert "__init__ cannot take the runner info" in attention_class_problem(InitWithoutInfo)
    assert "__init__ cannot take the runner info" in attention_class_problem(InitWithRequiredKeyword)
    check_attention_class(Good, "good", "cpu", "float32", 64)
    with pytest.raises(PluginError, match="'good' does not support cuda/int8/head_dim=64"):
        check_attention_class(type("Refuses", (Good,), {"supports": classmethod(lambda cls, *a: False)}), "good",
                              "cuda", "int8", 64)


def _config(path: str, attention: str) -> Config:
    return Config.build({"model": {"path": path}, "stack": {"attention": attention},
                         "runtime": {"device": "cpu", "num_threads": 1}, "scheduler": {"max_total_tokens": 256}})


@pytest.mark.parametrize("name", sorted(set(PROBLEMS) - {"refuses64"}))  # the tiny checkpoints' heads are 16
def test_the_model_runner_refuses_it_before_the_weights_load(on_path, tiny_llama_dir, monkeypatch, name):
    """Every entry point builds its model through the ModelRunner (generate in process, serve and Engine in the
    scheduler process): the class problems come before the checkpoint is opened, supports() once its config is read."""
    import radixserve.model_runner as model_runner

    def never(*args, **kwargs):
        raise AssertionError("reached the weights")

    monkeypatch.setattr(model_runner, "load_model", never)
    if name != "refuses16":  # no model config needed: before the checkpoint is even opened
        monkeypatch.setattr(model_runner, "open_checkpoint", never)
    config = _config(tiny_llama_dir("llama"), name)
    with pytest.raises(PluginError, match=f"attention backend '{name}'.*{PROBLEMS[name]}"):
        model_runner.ModelRunner(config, Registry.from_config(config))


def test_generate_and_config_show_say_it_in_one_line(on_path, tiny_llama_dir, capsys):
    from radixserve.cli import main

    model = tiny_llama_dir("llama")
    capsys.readouterr()  # writing the checkpoint's progress bar
    commands = [(["generate", "--model", MISSING_MODEL, "hi"], "nodecode"),
                (["generate", "--model", model, "--no-chat", "--max-tokens", "1", "hi"], "refuses16"),
                (["config", "show"], "noinit"),  # no model: the class itself
                (["config", "show"], "refuses64"),  # and its supports() on the default model (attention audit 33)
                (["config", "show", "--model", model], "refuses16")]
    for args, name in commands:
        assert main([*args, f"stack.attention={name}"]) == 2, args
        err = capsys.readouterr().err
        assert err.startswith(f"radixserve: error: attention backend '{name}'") and len(err.splitlines()) == 1, err
        assert re.search(PROBLEMS[name], err), err


def test_serve_and_engine_fail_with_the_message_and_no_traceback(site, on_path, tiny_llama_dir, monkeypatch):
    import os

    from radixserve.engine import Engine
    from server_process import with_tiny_tokenizer

    model = with_tiny_tokenizer(tiny_llama_dir("llama"))
    r = run_cli(["serve", "--model", model, "--port", "0", "stack.attention=nodecode", "runtime.num_threads=1"],
                site=site)
    assert r.returncode != 0 and PROBLEMS["nodecode"] in r.stderr and "Traceback" not in r.stderr, r.stderr
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]))
    with pytest.raises((RuntimeError, ValueError), match=PROBLEMS["nodecode"]):  # as the scheduler process says it
        Engine(model=model, stack={"attention": "nodecode"}, runtime={"device": "cpu", "num_threads": 1})


def test_a_plugin_error_at_start_up_is_said_without_a_traceback():
    assert not traceback_worth_showing(PluginError("stack.attention='x': ..."))
    assert traceback_worth_showing(RuntimeError("a bug"))


def test_an_attention_option_the_backend_lacks_is_refused_before_the_weights_load(on_path, tiny_llama_dir, monkeypatch):
    """Attention audit 33: a soft-capped model on a backend without supports_logit_cap was refused only after its
    weights loaded and its KV pool was allocated (12 s and 2 GiB for a tiny model in serve)."""
    from radixserve.model_loader.sources import ModelSource
    from radixserve.model_runner import ModelRunner

    def never(self, *args, **kwargs):
        raise AssertionError("reached the weights")

    monkeypatch.setattr(ModelSource, "iter_weights", never)
    model = tiny_llama_dir("gemma2")
    with pytest.raises(ValueError, match=r"attention layer 0 uses logit_cap=.*which attention backend 'nocap' does not "
                                         r"support \(supports_logit_cap is False\)"):
        ModelRunner(_config(model, "nocap"), Registry.discover(), show_progress=False)
