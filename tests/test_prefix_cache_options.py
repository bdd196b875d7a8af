"""`stack.prefix_cache_options`: the keyword arguments a prefix cache is built with, after the ReqToTokenPool and
the TokenAllocator (`Cache(req_to_token_pool, allocator, **options)`), as `stack.policy_options` are a policy's.
Before, the scheduler built every cache as `cache_cls(pool, allocator)`: a plugin's cache with a knob (an LRU
cache's capacity) could not be configured at all. The names are checked when the stack is resolved, before any
model loads; a later layer that names another cache drops them (config.merge_layers)."""

from __future__ import annotations

import argparse
import logging
import sys
import types

import pytest
from plugin_fixtures import make_fake_distribution, run_cli
from radixserve.cli import load_config_from_args
from radixserve.config import Config, merge_layers
from radixserve.plugins.registry import PluginCodeError, PluginError, Registry
from radixserve.plugins.stack import resolve_stack
from radixserve_cache_chunk.chunk_cache import ChunkCache

MISSING_MODEL = "/nonexistent/models/SmolLM2-135M-Instruct.Q4_1.gguf"


class CappedCache(ChunkCache):
    """A cache with an option (what a plugin's LRU cache with a capacity looks like)."""

    def __init__(self, req_to_token_pool, allocator, capacity: int = 4096) -> None:
        super().__init__(req_to_token_pool, allocator)
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity


class BuggyCache(ChunkCache):
    def __init__(self, req_to_token_pool, allocator, table: str = "x") -> None:
        super().__init__(req_to_token_pool, allocator)
        self.v = {}[table]


# a plugin module for the CLI, in its own process (a fake installed distribution)
CAPPED_PLUGIN = """
from radixserve.plugins import hookimpl
from radixserve_cache_chunk.chunk_cache import ChunkCache

PLUGIN_API = ">=1,<2"


class CappedCache(ChunkCache):
    def __init__(self, req_to_token_pool, allocator, capacity: int = 4096) -> None:
        super().__init__(req_to_token_pool, allocator)
        self.capacity = capacity


@hookimpl
def radixserve_register(registry):
    registry.register("prefix_cache", "capped", "radixserve_capped_cache:CappedCache")
"""


@pytest.fixture(scope="module")
def registry() -> Registry:
    """The installed components plus `capped` and `buggy-cache`, registered by 'radixserve-capped 0.1.0'."""

    def register(registry):
        registry.register("prefix_cache", "capped", f"{__name__}:CappedCache")
        registry.register("prefix_cache", "buggy-cache", f"{__name__}:BuggyCache")

    mod = types.ModuleType("capped")
    mod.PLUGIN_API, mod.radixserve_register = ">=1,<2", register
    reg = Registry.discover()
    reg.add_plugin_module(mod, name="capped", distribution="radixserve-capped", version="0.1.0")
    return reg


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    site = tmp_path_factory.mktemp("site")
    make_fake_distribution(site, "radixserve-capped", "capped", "radixserve_capped_cache", CAPPED_PLUGIN)
    return site


def cli_config(path, *overrides: str) -> Config:
    """The Config the command line builds from `--config path` and `section.key=value` overrides."""
    args = argparse.Namespace(config=str(path) if path else None, overrides=list(overrides), p=None)
    return load_config_from_args(args, None)


def stack_file(tmp_path, text: str):
    f = tmp_path / "stack.yaml"
    f.write_text(text)
    return f


def built_cache(config: Config, registry: Registry):
    """The cache the scheduler builds from `config` (over the toy runner's pool and allocator)."""
    from radixserve.scheduler import Scheduler
    from radixserve.testing.toy_runner import ToyRunner

    runner = ToyRunner(max_total_tokens=64)
    sched = Scheduler.from_config(config.with_overrides({"stack": {"grammar": "none"}}), runner, registry)
    cache = sched.cache
    assert cache.req_to_token_pool is runner.req_to_token_pool and cache.allocator is runner.token_allocator
    return cache


# ---- the options reach the cache's constructor ------------------------------------------------
def test_a_stack_file_sets_the_cache_options_and_the_scheduler_builds_the_cache_with_them(tmp_path, registry):
    config = cli_config(stack_file(tmp_path, "stack: {prefix_cache: capped, prefix_cache_options: {capacity: 7}}\n"))
    assert config.stack.prefix_cache_options == {"capacity": 7}
    assert resolve_stack(config, registry, "cpu").prefix_cache_options == {"capacity": 7}
    cache = built_cache(config, registry)
    assert isinstance(cache, CappedCache) and cache.capacity == 7


def test_overrides_set_the_cache_options_alone_or_over_a_stack_file(tmp_path, registry):
    config = cli_config(None, "stack.prefix_cache=capped", "stack.prefix_cache_options={capacity: 5}")
    assert built_cache(config, registry).capacity == 5
    config = cli_config(None, "stack.prefix_cache=capped", "stack.prefix_cache_options.capacity=6")
    assert built_cache(config, registry).capacity == 6
    f = stack_file(tmp_path, "stack: {prefix_cache: capped, prefix_cache_options: {capacity: 7}}\n")
    config = cli_config(f, "stack.prefix_cache_options.capacity=9")  # one option of the file's changed
    assert config.stack.prefix_cache_options == {"capacity": 9}
    assert built_cache(config, registry).capacity == 9
    config = cli_config(f, "stack.prefix_cache_options={}")  # cleared: the cache's default
    assert built_cache(config, registry).capacity == 4096


def test_without_options_the_cache_is_built_with_the_pool_and_allocator_only(registry):
    assert built_cache(Config.build({"stack": {"prefix_cache": "capped"}}), registry).capacity == 4096
    assert resolve_stack(Config.build({}), registry, "cpu").prefix_cache_options == {}


# ---- checked at start-up -----------------------------------------------------------------------
def test_an_unknown_option_is_refused_at_resolution_naming_it_and_the_valid_ones(registry):
    config = Config.build({"stack": {"prefix_cache": "capped", "prefix_cache_options": {"capacty": 8, "ttl": 1}}})
    with pytest.raises(PluginError) as e:
        resolve_stack(config, registry, "cpu")
    assert str(e.value) == ("stack.prefix_cache_options: prefix cache 'capped' has no option 'capacty', 'ttl'; "
                            "valid options: capacity")
    # a cache whose constructor takes only the pool and the allocator takes no options
    with pytest.raises(PluginError, match=r"^stack.prefix_cache_options: prefix cache 'radix' has no option 'size'; "
                                          r"it takes no options \(the first two parameters of its __init__ take the "
                                          r"ReqToTokenPool and the TokenAllocator\)$"):
        resolve_stack(Config.build({"stack": {"prefix_cache_options": {"size": 8}}}), registry, "cpu")


def test_config_show_prints_the_options_and_refuses_an_unknown_one(site):
    r = run_cli(["config", "show", "stack.prefix_cache=capped", "stack.prefix_cache_options.capacity=7"], site=site)
    assert r.returncode == 0, r.stderr
    assert "  prefix_cache: capped  # stack.prefix_cache; radixserve-capped 1.0\n" in r.stdout, r.stdout
    assert "  prefix_cache_options: {'capacity': 7}\n" in r.stdout, r.stdout
    r = run_cli(["config", "show", "stack.prefix_cache=capped", "stack.prefix_cache_options.capacty=7"], site=site)
    assert r.returncode == 2, r.stderr
    assert ("stack.prefix_cache_options: prefix cache 'capped' has no option 'capacty'; valid options: capacity"
            in r.stderr), r.stderr
    assert "Traceback" not in r.stderr


def test_serve_refuses_an_unknown_option_before_loading_the_model(site):
    r = run_cli(["serve", "--model", MISSING_MODEL, "stack.prefix_cache=capped",
                 "stack.prefix_cache_options={capacty: 7}"], site=site)
    assert r.returncode == 2, r.stderr
    assert "prefix cache 'capped' has no option 'capacty'; valid options: capacity" in r.stderr, r.stderr
    assert "does not exist" not in r.stderr and "Traceback" not in r.stderr


def test_a_value_the_cache_refuses_is_an_options_error_and_a_bug_names_the_cache(registry):
    config = Config.build({"stack": {"prefix_cache": "capped", "prefix_cache_options": {"capacity": 0}}})
    resolve_stack(config, registry, "cpu")  # names only: the cache needs the KV memory to be built
    with pytest.raises(PluginError, match=r"^stack.prefix_cache_options for prefix cache 'capped': capacity must be "
                                          r">= 1, got 0$") as e:
        built_cache(config, registry)
    assert not isinstance(e.value, PluginCodeError)
    with pytest.raises(PluginCodeError, match=r"^prefix_cache 'buggy-cache' \(radixserve-capped 0.1.0\) failed to "
                                              r"build: KeyError: 'x'$"):
        built_cache(Config.build({"stack": {"prefix_cache": "buggy-cache"}}), registry)


def test_without_options_the_cache_class_is_not_loaded_at_resolution(tmp_path, monkeypatch):
    """A cache imports torch, which the HTTP front end (it resolves the stack too) does not: its class is loaded
    to check options only when there are options."""
    (tmp_path / "lazy_cache_mod.py").write_text(
        "from radixserve_cache_chunk.chunk_cache import ChunkCache\n\n"
        "class LazyCache(ChunkCache):\n"
        "    def __init__(self, req_to_token_pool, allocator, capacity=1):\n"
        "        super().__init__(req_to_token_pool, allocator)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "lazy_cache_mod", raising=False)

    def register(registry):
        registry.register("prefix_cache", "lazy", "lazy_cache_mod:LazyCache")

    mod = types.ModuleType("lazy")
    mod.PLUGIN_API, mod.radixserve_register = ">=1,<2", register
    reg = Registry.discover()
    reg.add_plugin_module(mod, name="lazy", distribution="radixserve-lazy", version="0.1.0")
    resolve_stack(Config.build({"stack": {"prefix_cache": "lazy"}}), reg, "cpu")
    assert "lazy_cache_mod" not in sys.modules
    config = Config.build({"stack": {"prefix_cache": "lazy", "prefix_cache_options": {"capacity": 2}}})
    assert resolve_stack(config, reg, "cpu").prefix_cache_options == {"capacity": 2}
    assert "lazy_cache_mod" in sys.modules


# ---- layering: the options belong to the cache named beside them --------------------------------
def test_a_later_layer_naming_another_cache_drops_the_options(tmp_path, registry, caplog):
    f = stack_file(tmp_path, "stack: {prefix_cache: capped, prefix_cache_options: {capacity: 7}}\n")
    with caplog.at_level(logging.WARNING, logger="radixserve.config"):
        config = cli_config(f, "stack.prefix_cache=radix")
    assert config.stack.prefix_cache == "radix" and config.stack.prefix_cache_options == {}
    resolve_stack(config, registry, "cpu")  # radix takes no options: the file's would be refused
    assert "stack.prefix_cache is now 'radix' (was 'capped')" in caplog.text, caplog.text
    assert "stack.prefix_cache_options {'capacity': 7}" in caplog.text and "dropped" in caplog.text
    # naming the same cache again keeps them; the new cache's own options replace the old one's
    assert cli_config(f, "stack.prefix_cache=capped").stack.prefix_cache_options == {"capacity": 7}
    merged = merge_layers({"stack": {"prefix_cache": "capped", "prefix_cache_options": {"capacity": 7}}},
                          {"stack": {"prefix_cache": "other", "prefix_cache_options": {"ways": 4}}})
    assert merged["stack"]["prefix_cache_options"] == {"ways": 4}
    # options whose cache the earlier layer left to the default wait for the one a later layer names
    merged = merge_layers({"stack": {"prefix_cache_options": {"capacity": 7}}}, {"stack": {"prefix_cache": "capped"}})
    assert merged["stack"]["prefix_cache_options"] == {"capacity": 7}


def test_engine_keywords_over_a_config_file_drop_the_files_cache_options(tmp_path):
    from radixserve.engine import engine_config

    f = stack_file(tmp_path, "stack: {prefix_cache: capped, prefix_cache_options: {capacity: 7}}\n")
    config = engine_config(None, str(f), None, {"stack": {"prefix_cache": "chunk"}})
    assert config.stack.prefix_cache == "chunk" and config.stack.prefix_cache_options == {}


def test_generate_names_the_cache_options_among_the_keys_it_does_not_use():
    from radixserve.cli_generate import scheduler_only_keys

    config = Config.build({"stack": {"prefix_cache_options": {"capacity": 7}}})
    assert scheduler_only_keys(config) == ["stack.prefix_cache_options"]
