"""Plugin discovery and the registry's guarantees: conflicts, versions, allow/deny lists, lazy loading."""

from __future__ import annotations

import json
import re
import sys
import types

import pytest
from plugin_fixtures import POLICY_PLUGIN, make_fake_distribution, run_cli
from radixserve.interfaces import SchedulePolicy
from radixserve.plugins.registry import PluginError, Registry
from radixserve.version import PLUGIN_API_VERSION


def _module(name: str, api: str | None, register=None) -> types.ModuleType:
    mod = types.ModuleType(name)
    if api is not None:
        mod.PLUGIN_API = api
    if register is not None:
        mod.radixserve_register = register
    return mod


def test_installed_plugins_are_discovered_with_their_distribution():
    reg = Registry.discover()
    spec = reg.get("policy", "fcfs")
    assert spec.distribution == "radixserve-policies"
    assert issubclass(reg.load("policy", "fcfs"), SchedulePolicy)
    assert reg.get("quantization", "unquantized").distribution == "radixserve"


def test_registration_is_lazy_until_load():
    mod_name = "radixserve_test_lazy_target"
    sys.modules.pop(mod_name, None)
    reg = Registry()

    def register(registry):
        registry.register("policy", "lazy", f"{mod_name}:Nope")

    reg.add_plugin_module(_module("lazyplug", ">=1,<2", register), name="lazyplug", distribution="lazy-dist")
    assert mod_name not in sys.modules  # declared, not imported
    with pytest.raises(PluginError, match="cannot import"):
        reg.load("policy", "lazy")


def test_duplicate_component_names_both_distributions():
    reg = Registry()
    for dist in ("dist-alpha", "dist-beta"):
        reg.add_plugin_module(
            _module(dist, ">=1,<2", lambda registry: registry.register("policy", "same", "m:C")),
            name=dist,
            distribution=dist,
        )
    with pytest.raises(PluginError) as e:
        reg.check_conflicts()
    assert "dist-alpha" in str(e.value) and "dist-beta" in str(e.value) and "'same'" in str(e.value)


def test_duplicate_resolved_by_preference():
    reg = Registry(prefer={"policy/same": "dist-beta"})
    for dist in ("dist-alpha", "dist-beta"):
        reg.add_plugin_module(
            _module(dist, ">=1,<2", lambda registry, d=dist: registry.register("policy", "same", f"{d}:C")),
            name=dist,
            distribution=dist,
        )
    reg.check_conflicts()
    assert reg.get("policy", "same").distribution == "dist-beta"


def test_incompatible_api_version_is_refused_clearly():
    reg = Registry()
    with pytest.raises(PluginError) as e:
        reg.add_plugin_module(_module("old", ">=2,<3"), name="old", distribution="radixserve-old-plugin", version="0.3")
    msg = str(e.value)
    assert "radixserve-old-plugin" in msg and ">=2,<3" in msg and PLUGIN_API_VERSION in msg


def test_api_mismatch_advice_depends_on_which_side_is_behind():
    """An outsider's plugin asking for a newer core (>=1.8 on a 1.7 core) was told to upgrade the plugin."""
    major, minor = (int(x) for x in PLUGIN_API_VERSION.split(".")[:2])
    cases = {f">={major}.{minor + 1},<{major + 1}": "upgrade radixserve", f">={major + 1}": "upgrade radixserve",
             f">=0.1,<{major}.0": "upgrade the plugin", f"=={major}.{minor - 1}" if minor else "<0": "upgrade the plugin"}
    # bounds far ahead of the core (majors from 6 on were told to upgrade the plugin), compatible-release
    # and wildcard forms, and plugins built for older cores
    cases.update({f">={m},<{m + 1}": "upgrade radixserve" for m in (2, 5, 6, 7, 9, 10, 42)})
    cases.update({">=9": "upgrade radixserve", ">=20.3": "upgrade radixserve", f"~={major}.{minor + 1}": "upgrade radixserve",
                  f"=={major + 7}.*": "upgrade radixserve", f">{major}.{minor}": "upgrade radixserve",
                  f"<{major}.{minor}": "upgrade the plugin", f">=0.1,<{major}": "upgrade the plugin"})
    for api, advice in cases.items():
        with pytest.raises(PluginError) as e:
            Registry().add_plugin_module(_module("p", api), name="p", distribution="p-dist")
        assert advice in str(e.value) and "RADIXSERVE_DISABLE_PLUGINS=p" in str(e.value), (api, str(e.value))
        other = "upgrade the plugin" if advice == "upgrade radixserve" else "upgrade radixserve"
        assert other not in str(e.value), (api, str(e.value))


@pytest.mark.parametrize("api", [">=1", ">=1.0", ">1", "!=0.5", ">=1,<3", ">=1,<=2.0"])
def test_a_range_open_past_the_next_major_is_refused(api):
    """Audit 29: `PLUGIN_API = ">=1"` (no upper bound) was accepted; a 2.x core would then load it."""
    major = int(PLUGIN_API_VERSION.split(".")[0])
    with pytest.raises(PluginError, match=rf"declares PLUGIN_API '{re.escape(api)}', which also admits plugin API "
                                          rf"{major + 1} and later.*PLUGIN_API = '{re.escape(api)},<{major + 1}'"):
        Registry().add_plugin_module(_module("open", api), name="open", distribution="open-dist")
    Registry().add_plugin_module(_module("bounded", f"{api},<{major + 1}"), name="bounded", distribution="b-dist")


def test_missing_api_declaration_is_refused():
    with pytest.raises(PluginError, match="PLUGIN_API"):
        Registry().add_plugin_module(_module("noapi", None), name="noapi", distribution="noapi-dist")


@pytest.mark.parametrize("api", ["", " ", "\t"])
def test_an_empty_api_declaration_is_refused_like_a_missing_one(api):
    """Audit 29: `PLUGIN_API = ""` (an empty specifier set, which admits every version) was accepted."""
    with pytest.raises(PluginError, match=r"plugin 'blank' from blank-dist declares an empty PLUGIN_API .*PLUGIN_API ="):
        Registry().add_plugin_module(_module("blank", api), name="blank", distribution="blank-dist")


def test_unknown_kind_is_refused():
    reg = Registry()
    with pytest.raises(PluginError, match="unknown kind 'sampler'"):
        reg.add_plugin_module(
            _module("bad", ">=1,<2", lambda registry: registry.register("sampler", "x", "m:C")),
            name="bad",
            distribution="bad-dist",
        )


def test_unknown_component_lists_installed_and_install_hint():
    reg = Registry.discover()
    with pytest.raises(PluginError) as e:
        reg.get("policy", "lpm-typo")
    assert "fcfs" in str(e.value) and "installed policy components" in str(e.value)
    reg2 = Registry()
    with pytest.raises(PluginError, match="pip install radixserve-attention-triton"):
        reg2.get("attention", "triton")


def test_load_checks_base_class():
    reg = Registry()
    reg.add_plugin_module(
        _module("wrong", ">=1,<2", lambda registry: registry.register("policy", "wrong", "json:JSONDecoder")),
        name="wrong",
        distribution="wrong-dist",
    )
    with pytest.raises(PluginError, match="not a subclass"):
        reg.load("policy", "wrong")


# ---- through real entry points (fake distributions on PYTHONPATH, CLI in a subprocess) --------
def test_conflicting_distributions_fail_at_startup(tmp_path):
    for dist, mod in (("radixserve-conflict-a", "rs_conflict_a"), ("radixserve-conflict-b", "rs_conflict_b")):
        make_fake_distribution(tmp_path, dist, mod, mod, POLICY_PLUGIN.format(api=">=1,<2", name="fcfs"))
    r = run_cli(["config", "show"], site=tmp_path)
    assert r.returncode == 2
    assert "radixserve-conflict-a" in r.stderr and "radixserve-conflict-b" in r.stderr and "radixserve-policies" in r.stderr
    assert "Traceback" not in r.stderr


def test_the_plugins_listing_names_a_conflict_by_plugin_and_still_lists_the_rest(tmp_path):
    """Audit 30: with two distributions registering one name `radixserve plugins` (and --json) printed only
    the error, and the error asked for RADIXSERVE_DISABLE_PLUGINS=<plugin> without naming the plugins."""
    for dist, mod in (("radixserve-conflict-a", "rs_conflict_a"), ("radixserve-conflict-b", "rs_conflict_b")):
        make_fake_distribution(tmp_path, dist, mod, mod, POLICY_PLUGIN.format(api=">=1,<2", name="dup"))
    r = run_cli(["plugins"], site=tmp_path)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert "cpu_batched" in r.stdout  # the rest of the listing
    section = r.stdout.split("components registered twice")[1]
    assert ("policy/dup: policy component 'dup' is registered by both radixserve-conflict-a (plugin 'rs_conflict_a') "
            "and radixserve-conflict-b (plugin 'rs_conflict_b')") in section
    assert "RADIXSERVE_DISABLE_PLUGINS=rs_conflict_b" in section
    listing = json.loads(run_cli(["plugins", "--json"], site=tmp_path).stdout)
    assert [c["component"] for c in listing["conflicts"]] == ["policy/dup"]
    assert not any(c["name"] == "dup" for c in listing["components"])


@pytest.mark.parametrize("wanted", ["dist-beta", "plugin-beta"])
def test_prefer_takes_the_distribution_or_its_plugin_name(wanted):
    """Audit 30: plugins.disable takes entry-point names, prefer took only distributions: 'plugin-beta'
    was silently not a match."""
    reg = Registry(prefer={"policy/same": wanted})
    for dist in ("dist-alpha", "dist-beta"):
        reg.add_plugin_module(_module(dist, ">=1,<2", lambda registry, d=dist: registry.register("policy", "same", f"{d}:C")),
                              name=dist.replace("dist", "plugin"), distribution=dist)
    reg.check_conflicts()
    assert reg.get("policy", "same").distribution == "dist-beta"


def test_a_prefer_entry_that_settles_nothing_is_named(caplog):
    reg = Registry(prefer={"policy/same": "nope", "policy/alone": "dist-other", "polcy/typo": "dist-alpha"})
    for dist in ("dist-alpha", "dist-beta"):
        reg.add_plugin_module(_module(dist, ">=1,<2", lambda registry: registry.register("policy", "same", "m:C")),
                              name=dist, distribution=dist)
    reg.add_plugin_module(_module("dist-gamma", ">=1,<2", lambda registry: registry.register("policy", "alone", "m:C")),
                          name="gamma", distribution="dist-gamma")
    with pytest.raises(PluginError, match=r"plugins.prefer names 'nope' for it, which is neither"):
        reg.check_conflicts()
    reg.prefer.pop("policy/same")
    reg._conflicts.clear()
    with caplog.at_level("WARNING", logger="radixserve.plugins.registry"):
        reg.check_conflicts()
    assert "plugins.prefer names 'dist-other' for policy/alone, which only dist-gamma (plugin 'gamma') registers" in caplog.text
    assert "plugins.prefer names 'polcy/typo', which no loaded plugin registers" in caplog.text


def test_version_mismatch_fails_at_startup(tmp_path):
    make_fake_distribution(tmp_path, "radixserve-future", "future", "rs_future", POLICY_PLUGIN.format(api=">=2", name="f"))
    r = run_cli(["config", "show"], site=tmp_path)
    assert r.returncode == 2 and "radixserve-future" in r.stderr and "plugin API" in r.stderr
    assert "Traceback" not in r.stderr


HALF_REGISTERED_PLUGIN = """
from radixserve.plugins import hookimpl
PLUGIN_API = ">=1,<2"

@hookimpl
def radixserve_register(registry):
    registry.register("policy", "half-done", "radixserve_policies.fcfs:FCFSPolicy")
    raise RuntimeError("my register hook has a bug")
"""


def test_the_plugins_listing_names_broken_plugins_and_still_lists_the_rest(tmp_path):
    """`radixserve plugins` is the diagnostic a plugin author runs; one incompatible plugin aborted the whole listing
    (a plugin author's audit, session 27). It now lists everything that loads, names each plugin that failed with
    its error, and exits 1; every other command still refuses to start (above)."""
    make_fake_distribution(tmp_path, "radixserve-future", "future", "rs_future", POLICY_PLUGIN.format(api=">=2", name="f"))
    make_fake_distribution(tmp_path, "radixserve-half", "half", "rs_half", HALF_REGISTERED_PLUGIN)
    r = run_cli(["plugins"], site=tmp_path)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert "radixserve-policies" in r.stdout and "cpu_batched" in r.stdout  # the rest of the listing
    broken = r.stdout.split("plugins that failed to load")[1]
    assert "future (radixserve-future):" in broken and "plugin API" in broken
    assert "half (radixserve-half):" in broken and "my register hook has a bug" in broken
    assert "half-done" not in r.stdout  # what the failed hook registered before raising is not listed
    listing = json.loads(run_cli(["plugins", "--json"], site=tmp_path).stdout)
    assert {b["plugin"] for b in listing["broken"]} == {"future", "half"}
    assert not any(c["name"] == "half-done" for c in listing["components"])


def test_allow_and_deny_lists(tmp_path):
    make_fake_distribution(tmp_path, "radixserve-extra", "extra", "rs_extra", POLICY_PLUGIN.format(api=">=1,<2", name="extra"))
    names = lambda r: {c["name"] for c in json.loads(r.stdout)["components"]}  # noqa: E731
    everything = run_cli(["plugins", "--json"], site=tmp_path)
    assert everything.returncode == 0, everything.stderr
    assert {"extra", "fcfs"} <= names(everything)
    denied = run_cli(["plugins", "--json", "-p", "no:extra"], site=tmp_path)
    assert "extra" not in names(denied) and "fcfs" in names(denied)
    # audit 30: the skipped plugin was not shown at all
    assert {"plugin": "extra", "distribution": "radixserve-extra", "reason": "plugins.disable"} in json.loads(
        denied.stdout)["skipped"]
    table = run_cli(["plugins", "-p", "no:extra"], site=tmp_path).stdout
    assert "plugins installed but not loaded:\n  extra (radixserve-extra): plugins.disable" in table
    denied_env = run_cli(["plugins", "--json"], site=tmp_path, env={"RADIXSERVE_DISABLE_PLUGINS": "extra"})
    assert "extra" not in names(denied_env)
    allowed = run_cli(["plugins", "--json"], site=tmp_path, env={"RADIXSERVE_PLUGINS": "extra"})
    core = {"unquantized", "oracle", "hermes", "llama3_json", "mistral", "pythonic", "qwen3", "deepseek_r1"}
    assert names(allowed) == {"extra"} | core  # the core's own components are always there


# ---- one registry per process, from the Config -----------------------------------------------
def test_from_config_honours_the_stack_plugins_section():
    from radixserve.config import Config

    reg = Registry.from_config(Config.build({"plugins": {"disable": ["policies"]}}))
    assert "policies" not in reg.plugins and "fcfs" not in reg.names("policy")
    # installed but disabled: the error says so instead of suggesting to pip install it
    with pytest.raises(PluginError, match=r"named 'fcfs' is loaded;.*not loaded: policies of radixserve-policies \(plugins.disable\)") as e:
        reg.get("policy", "fcfs")
    assert "pip install" not in str(e.value)


def test_a_deny_entry_naming_no_plugin_is_reported(caplog):
    # a typo, or the distribution's name instead of the plugin's, used to disable nothing silently
    with caplog.at_level("WARNING", logger="radixserve.plugins.registry"):
        Registry.discover(deny={"radixserve-policies", "no_such_plugin"})
    text = caplog.text
    assert "'radixserve-policies' is the distribution of plugin 'policies'" in text, text
    assert "'no_such_plugin', which is no installed plugin" in text and "installed plugins: " in text, text


def test_the_allow_list_names_what_it_left_out():
    reg = Registry.discover(allow={"llama"})
    with pytest.raises(PluginError, match=r"not loaded: .*radix.* \(not in the allow-list llama\)"):
        reg.get("prefix_cache", "radix")


# ---- the weight-source role: a file is read by the component that declared its suffix --------
WEIGHT_SOURCE_MODULE = "radixserve_test_weight_source"


def _register_weight_source(tmp_path, monkeypatch, base: str = "WeightSource") -> Registry:
    (tmp_path / f"{WEIGHT_SOURCE_MODULE}.py").write_text(
        "from radixserve.interfaces.quantization import WeightSource\n"
        "from radixserve.layers.quant_unquantized import UnquantizedMethod\n"
        f"class Reader(UnquantizedMethod{', WeightSource' if base else ''}):\n"
        "    def hf_config(self, path):\n        return {'read': path}\n"
        "    def iter_weights(self, path, hf_config):\n        return iter(())\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop(WEIGHT_SOURCE_MODULE, None)
    reg = Registry()
    reg.add_builtin()
    reg.add_plugin_module(
        _module("myformat", ">=1,<2", lambda registry: registry.register(
            "quantization", "myformat", f"{WEIGHT_SOURCE_MODULE}:Reader", weight_file_suffixes=(".myw",))),
        name="myformat", distribution="radixserve-myformat",
    )
    return reg


def test_weight_source_is_found_by_file_suffix_not_by_name(tmp_path, monkeypatch):
    from radixserve.model_loader import open_source

    reg = _register_weight_source(tmp_path, monkeypatch)
    ckpt = tmp_path / "model.MYW"
    ckpt.write_bytes(b"x")
    source = open_source(str(ckpt), "auto", reg)
    assert source.format == "myformat" and source.hf_config() == {"read": str(ckpt)}
    other = tmp_path / "model.bin"
    other.write_bytes(b"x")
    with pytest.raises(ValueError, match=r"no installed weight source reads this file type.*\.myw"):
        open_source(str(other), "auto", reg)


def test_plugins_command_shows_which_file_suffix_each_weight_source_reads(tmp_path, monkeypatch, capsys):
    """An outsider's weight source appeared in `radixserve plugins` as one more quantization row,
    with no sign of the file type it claims."""
    import argparse

    from radixserve import cli

    reg = _register_weight_source(tmp_path, monkeypatch)
    monkeypatch.setattr(cli.Registry, "discover", classmethod(lambda cls, **kw: reg))
    cli.cmd_plugins(argparse.Namespace(p=None, json=False))
    text = capsys.readouterr().out
    assert re.search(r"checkpoint files.*\n(.*\n)*  \.myw +myformat +radixserve-myformat", text), text
    cli.cmd_plugins(argparse.Namespace(p=None, json=True))
    rows = json.loads(capsys.readouterr().out)["components"]
    assert [r["weight_file_suffixes"] for r in rows if r["name"] == "myformat"] == [[".myw"]]


def test_plugins_json_gives_each_components_class_reference():
    """Audit 29: check_model_parity needs a family's class, and nothing said where it lives."""
    listing = json.loads(run_cli(["plugins", "--json"]).stdout)
    refs = {(c["kind"], c["name"]): c["ref"] for c in listing["components"]}
    assert refs[("model", "LlamaForCausalLM")] == "radixserve_models_llama.model:LlamaForCausalLM"
    assert refs[("quantization", "unquantized")] == "radixserve.layers.quant_unquantized:UnquantizedMethod"


def test_weight_source_must_implement_the_role(tmp_path, monkeypatch):
    reg = _register_weight_source(tmp_path, monkeypatch, base="")
    with pytest.raises(PluginError, match="WeightSource"):
        reg.load("quantization", "myformat")


def test_gguf_without_its_plugin_names_the_package(smollm2_gguf_path):
    from radixserve.model_loader import detect_format

    reg = Registry.discover(deny={"gguf"})
    with pytest.raises(ValueError, match="pip install radixserve-quant-gguf"):
        detect_format(smollm2_gguf_path, "auto", reg)


def test_plugins_table_names_the_plugin_and_survives_a_closed_pipe():
    # the table's first column is the entry-point name that -p no:NAME takes (it showed only the
    # distribution); `radixserve plugins | head` used to end in a BrokenPipeError traceback
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "radixserve.cli", "plugins"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    header = proc.stdout.readline()
    proc.stdout.close()  # as `head -1` does
    _, err = proc.communicate(timeout=60)
    assert header.split()[:2] == ["plugin", "distribution"], header
    assert proc.returncode == 0 and "Traceback" not in err, err


SOURCE_PLUGIN = """
from radixserve.plugins import hookimpl
PLUGIN_API = ">=1,<2"

@hookimpl
def radixserve_register(registry):
    registry.register("quantization", "{name}", "radixserve_quant_gguf.method:GGUFMethod", priority={priority},
                      weight_file_suffixes=(".npzw",))
"""


def test_the_plugins_listing_says_which_reader_takes_a_suffix_two_claim(tmp_path):
    """Weight-source audit 34: a second reader of a suffix silently shadowed the first."""
    for dist, mod, name, priority in (("radixserve-ws-low", "rs_ws_low", "low_reader", 1),
                                      ("radixserve-ws-high", "rs_ws_high", "high_reader", 9)):
        make_fake_distribution(tmp_path, dist, mod, mod, SOURCE_PLUGIN.format(name=name, priority=priority))
    r = run_cli(["plugins"], site=tmp_path)
    assert r.returncode == 0, r.stderr
    lines = [line for line in r.stdout.splitlines() if line.strip().startswith(".npzw")]
    assert any("high_reader" in line and "(reads these files)" in line for line in lines), lines
    assert any("low_reader" in line and "(not used: 'high_reader' comes first; -p no:<plugin> to switch)" in line
               for line in lines), lines


# ---- audit 37: a raising register hook, devices=, undecorated hooks -----------------------------
def _raising_register(registry):
    registry.register("policy", "half-done", "radixserve_policies.fcfs:FCFSPolicy")
    raise RuntimeError("register blew up")


def test_a_raising_register_hook_is_a_plugin_error_naming_the_plugin():
    """Audit 37 (D1): the hook's exception escaped bare, so every command died with a traceback, exit 1."""
    reg = Registry()
    with pytest.raises(PluginError) as e:
        reg.add_plugin_module(_module("broken", ">=1,<2", _raising_register), name="broken",
                              distribution="radixserve-broken", version="0.1.0")
    msg = str(e.value)
    assert msg.startswith("plugin 'broken' from radixserve-broken 0.1.0 failed in radixserve_register: "
                          "RuntimeError: register blew up; "), msg
    assert "-p no:broken" in msg and "RADIXSERVE_DISABLE_PLUGINS=broken" in msg and "\n" not in msg
    assert isinstance(e.value.__cause__, RuntimeError)  # the traceback, for RADIXSERVE_DEBUG=1


def test_the_registrars_own_refusal_is_not_wrapped_again():
    reg = Registry()
    with pytest.raises(PluginError, match=r"^plugin 'bad' \(bad-dist\) registers unknown kind 'sampler'"):
        reg.add_plugin_module(_module("bad", ">=1,<2", lambda registry: registry.register("sampler", "x", "m:C")),
                              name="bad", distribution="bad-dist")


def test_every_command_stops_on_a_raising_register_hook_with_one_line(tmp_path):
    """Audit 37 (D1): `config show` (and serve) printed a bare traceback and exited 1, naming no distribution."""
    make_fake_distribution(tmp_path, "radixserve-broken", "broken", "rs_broken", HALF_REGISTERED_PLUGIN)
    r = run_cli(["config", "show"], site=tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert ("radixserve: error: plugin 'broken' from radixserve-broken 1.0 failed in radixserve_register: "
            "RuntimeError: my register hook has a bug; fix or uninstall it, or disable it: -p no:broken") in r.stderr
    assert run_cli(["config", "show", "-p", "no:broken"], site=tmp_path).returncode == 0  # the way out it names


def test_an_import_failure_names_the_way_to_disable_the_plugin():
    from radixserve.plugins.registry import _disable_hint

    assert _disable_hint("x") == ("fix or uninstall it, or disable it: -p no:x, plugins.disable: [x] in the stack, "
                                  "or RADIXSERVE_DISABLE_PLUGINS=x")


@pytest.mark.parametrize("devices, message", [
    ("cpu", r"devices must be a tuple or list of device types.*valid device types: cpu, cuda"),
    (("CPU",), r"'CPU' is not a device type; valid device types \(lowercase, without an index\): cpu, cuda"),
    (["cuda:0"], r"'cuda:0' is not a device type"),
    ((), r"name at least one device type"),
])
def test_register_refuses_devices_the_core_cannot_match(devices, message):
    """Audit 37 (D8): a bare "cpu" was listed as devices c,p,u; ("CPU",) was accepted, then refused every stack."""
    reg = Registry()
    hook = lambda registry: registry.register("policy", "p", "m:C", devices=devices)  # noqa: E731
    with pytest.raises(PluginError, match=r"^plugin 'pl' \(pl-dist\) registers policy 'p' with devices=.*?" + message):
        reg.add_plugin_module(_module("pl", ">=1,<2", hook), name="pl", distribution="pl-dist")


def test_register_takes_device_lists_and_the_device_types_are_runtime_devices():
    import typing

    from radixserve.config import Config
    from radixserve.plugins.registry import DEVICE_TYPES

    reg = Registry()
    reg.add_plugin_module(_module("pl", ">=1,<2", lambda registry: registry.register("policy", "p", "m:C", devices=["cuda"])),
                          name="pl", distribution="pl-dist")
    assert reg.get("policy", "p").devices == ("cuda",)
    assert set(DEVICE_TYPES) == set(typing.get_args(type(Config().runtime).model_fields["device"].annotation)) - {"auto"}


def test_an_undecorated_pluggy_hook_is_named_and_register_runs_without_the_decorator(caplog):
    """Audit 37 (G6): @hookimpl is optional on radixserve_register (called by name) but pluggy never calls an
    undecorated radixserve_stats / radixserve_add_routes: that was silent."""
    from radixserve.plugins import hookimpl

    calls = []
    mod = _module("nodeco", ">=1,<2", lambda registry: calls.append("register"))
    mod.radixserve_stats = lambda stats: calls.append("stats")
    reg = Registry()
    with caplog.at_level("WARNING", logger="radixserve.plugins.registry"):
        reg.add_plugin_module(mod, name="nodeco", distribution="nodeco-dist")
    reg.hook.radixserve_stats(stats={})
    assert calls == ["register"]
    assert "plugin 'nodeco' (nodeco-dist) defines radixserve_stats without @hookimpl, so it is never called" in caplog.text
    caplog.clear()
    decorated = _module("deco", ">=1,<2")
    decorated.radixserve_stats = hookimpl(lambda stats: calls.append("stats"))
    with caplog.at_level("WARNING", logger="radixserve.plugins.registry"):
        Registry().add_plugin_module(decorated, name="deco", distribution="deco-dist")
    assert "without @hookimpl" not in caplog.text
