"""Layering of a stack file, command-line overrides, flags and Engine keywords for a component's options
(plugin-author audit 37, D2): a stack file's `stack.policy_options` / `speculative.options` /
`model.weight_source_options` could not be cleared, so no override could switch such a file to another policy
or drafter (`stack.policy=lpm` failed on the file's option, `stack.policy_options={}` merged into the file's
and `=null` was refused). Now an explicit `{}` or null replaces the earlier options, and a later layer that
names another component drops the options the earlier layer gave the old one (logged). Everything else still
merges key by key."""

from __future__ import annotations

import argparse
import logging

import pytest
from radixserve.cli import load_config_from_args, main
from radixserve.config import Config, parse_dotted_overrides
from radixserve.engine import engine_config
from radixserve.plugins.registry import Registry
from radixserve.plugins.stack import resolve_stack

LOGGER = "radixserve.config"
STACK = """\
runtime: {device: cpu}
stack: {policy: random, policy_options: {seed: 3}, speculative: oracle}
speculative: {num_draft_tokens: 4, options: {accept_len: 2}}
scheduler: {max_running_requests: 8}
"""


@pytest.fixture
def stack_file(tmp_path):
    f = tmp_path / "stack.yaml"
    f.write_text(STACK)
    return f


def cli_config(path, *overrides: str, flags: dict | None = None) -> Config:
    args = argparse.Namespace(config=str(path), overrides=list(overrides), p=None)
    return load_config_from_args(args, flags)


def resolves(config: Config) -> None:
    resolve_stack(config, Registry.from_config(config), "cpu")  # the options are checked against the components


def test_an_override_that_names_another_policy_drops_the_files_options(stack_file, caplog):
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        config = cli_config(stack_file, "stack.policy=lpm")
    assert config.stack.policy == "lpm" and config.stack.policy_options == {}
    assert config.speculative.options == {"accept_len": 2}  # the drafter did not change: its options stay
    assert config.scheduler.max_running_requests == 8  # the rest of the file still applies
    resolves(config)
    assert "stack.policy is now 'lpm' (was 'random')" in caplog.text, caplog.text
    assert "stack.policy_options {'seed': 3}" in caplog.text and "dropped" in caplog.text


def test_the_new_policys_own_options_replace_the_old_ones(stack_file):
    config = cli_config(stack_file, "stack.policy=lpm", "stack.policy_options.fcfs_threshold=4")
    assert config.stack.policy_options == {"fcfs_threshold": 4}
    resolves(config)


@pytest.mark.parametrize("value", ["{}", "null", ""])
def test_an_empty_or_null_options_override_replaces_the_files(stack_file, value):
    config = cli_config(stack_file, f"stack.policy_options={value}", f"speculative.options={value}")
    assert config.stack.policy == "random" and config.stack.policy_options == {}
    assert config.speculative.options == {}
    config = cli_config(stack_file, "stack.policy=lpm", f"stack.policy_options={value}")
    assert config.stack.policy_options == {}
    resolves(config)


def test_an_override_for_the_same_component_still_merges_into_the_files_options(stack_file, caplog):
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        config = cli_config(stack_file, "stack.policy=random", "speculative.options.extra=1")
    assert config.stack.policy_options == {"seed": 3}
    assert config.speculative.options == {"accept_len": 2, "extra": 1}
    assert "dropped" not in caplog.text


def test_options_whose_component_an_earlier_layer_left_to_the_default_are_kept(tmp_path):
    """A file may hold the options of a drafter (or policy) that the command line names."""
    f = tmp_path / "opts.yaml"
    f.write_text("stack: {policy_options: {fcfs_threshold: 3}}\nspeculative: {options: {accept_len: 2}}\n")
    config = cli_config(f, "stack.policy=lpm", flags={"stack": {"speculative": "oracle"}})
    assert config.stack.policy_options == {"fcfs_threshold": 3} and config.speculative.options == {"accept_len": 2}
    resolves(config)


def test_an_override_that_names_another_drafter_drops_the_files_options(stack_file, caplog):
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        config = cli_config(stack_file, "stack.speculative=ngram")
    assert config.stack.speculative == "ngram" and config.speculative.options == {}
    assert config.speculative.num_draft_tokens == 4
    resolves(config)
    assert "stack.speculative is now 'ngram' (was 'oracle')" in caplog.text, caplog.text
    # a flag (serve --speculative NAME) is a later layer too; and turning speculation off leaves no options behind
    assert cli_config(stack_file, flags={"stack": {"speculative": "ngram"}}).speculative.options == {}
    off = cli_config(stack_file, "stack.speculative=null")
    assert off.stack.speculative is None and off.speculative.options == {}
    off.check_speculative_settings_used()  # the file's drafter options no longer say "no effect without a drafter"


def test_config_show_switches_a_stack_files_policy_and_drafter(stack_file, capsys):
    """The audit's reproduction: each of these failed on the file's options."""
    for overrides in (["stack.policy=lpm"], ["stack.policy=lpm", "stack.policy_options={}"],
                      ["stack.policy=lpm", "stack.policy_options=null"], ["stack.speculative=ngram"]):
        assert main(["config", "show", "--config", str(stack_file), *overrides]) == 0, capsys.readouterr().err
        out = capsys.readouterr().out
        assert "policy: lpm" in out or "drafter: ngram" in out, out


def test_engine_keywords_switch_the_policy_and_drafter_of_a_config_file(stack_file):
    for stack in ({"policy": "lpm"}, {"policy": "lpm", "policy_options": {}}):
        config = engine_config(None, stack_file, None, {"stack": stack})
        assert config.stack.policy == "lpm" and config.stack.policy_options == {}
        resolves(config)
    config = engine_config(None, stack_file, None, {"stack": {"speculative": "ngram"}})
    assert config.speculative.options == {}
    resolves(config)
    # a Config object as config=: its set keys are what the keywords override
    base = Config.load(stack_file)
    config = engine_config(None, base, None, {"stack": {"policy": "lpm"}, "speculative": {"options": {}}})
    assert config.stack.policy_options == {} and config.speculative.options == {}
    assert config.scheduler.max_running_requests == 8


def test_weight_source_options_follow_the_named_weight_source():
    from radixserve.config import merge_layers

    base = {"model": {"load_format": "gguf", "weight_source_options": {"dequantize": "auto"}}}
    assert merge_layers(base, {"model": {"load_format": "dummy"}})["model"]["weight_source_options"] == {}
    # auto reads the file with the weight source that declares its suffix: not known here, the options stay
    assert merge_layers(base, {"model": {"load_format": "auto"}})["model"]["weight_source_options"] == {
        "dequantize": "auto"}
    assert merge_layers(base, {"model": {"weight_source_options": None}})["model"]["weight_source_options"] == {}
    assert Config.build({"model": {"weight_source_options": None}}).model.weight_source_options == {}


def test_every_other_key_still_merges_as_before(stack_file):
    config = Config.load(stack_file, parse_dotted_overrides(["plugins.prefer={policy/lpm: a}", "scheduler.stream_interval=2"]))
    config = config.with_overrides({"plugins": {"prefer": {"drafter/ngram": "b"}}, "runtime": {"seed": 7}})
    assert config.plugins.prefer == {"policy/lpm": "a", "drafter/ngram": "b"}  # a mapping adds to the earlier one
    assert config.scheduler.max_running_requests == 8 and config.scheduler.stream_interval == 2
    assert config.runtime.device == "cpu" and config.runtime.seed == 7
    assert config.stack.policy_options == {"seed": 3}  # nothing named another policy
    # with_overrides keeps the whole config (defaults included) and leaves the original unchanged
    assert config.with_overrides({}) == config and Config().with_overrides({"stack": {"policy": "lpm"}}).stack.policy == "lpm"
