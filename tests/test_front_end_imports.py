"""The HTTP front end (the process that runs `radixserve serve`'s checks, the TokenizerManager and
the app) and the detokenizer import neither torch nor transformers: only the scheduler process
holds them (issue 14: the server's resident memory with a quantized GGUF). Device `auto` is
resolved without torch where torch could not use CUDA anyway."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
from radixserve.config import Config, torch_cannot_use_cuda
from server_process import child_pids, with_tiny_tokenizer

# what `radixserve serve` does in its own process before serving (cli_serve.run_serve, then
# server/launch.py), short of starting the children
FRONT_END = textwrap.dedent(
    """
    import sys
    from radixserve.config import Config
    from radixserve.plugins.registry import Registry
    from radixserve.plugins.stack import resolve_stack
    from radixserve.runtime.tokenizer_manager import TokenizerManager
    from radixserve.serving_tokenizer import load_serving_tokenizer
    from radixserve.server.app import create_app
    from radixserve.server.parser_selection import check_parser_names
    import radixserve.server.launch

    config = Config.build({{"model": {{"path": {path!r}}}}})
    registry = Registry.from_config(config)
    resolve_stack(config, registry, config.runtime.resolved_device())
    check_parser_names(config, registry)
    tm = TokenizerManager(config, registry)
    tm.tokenizer = load_serving_tokenizer(tm.model_path, config.model.tokenizer)
    create_app(tm, config, registry)
    ids = tm.apply_chat_template([{{"role": "user", "content": "hi"}}]) if tm.tokenizer.chat_template else []
    tm.tokenizer.decode(tm.tokenizer.encode("hello") + ids)
    print(sorted(m for m in ("torch", "transformers", "numpy") if m in sys.modules))
    """
)


def _front_end_modules(path: str, cache: str) -> str:
    env = {**os.environ, "RADIXSERVE_CACHE_DIR": cache}  # a fresh cache: the first load prepares it too
    out = subprocess.run([sys.executable, "-c", FRONT_END.format(path=path)], capture_output=True, text=True,
                         timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()[-1]


def test_the_front_end_of_the_default_gguf_imports_no_torch(smollm2_gguf_path, tmp_path):
    assert _front_end_modules(smollm2_gguf_path, str(tmp_path)) == "[]"


def test_the_front_end_of_an_hf_directory_imports_no_torch(tiny_llama_dir, tmp_path):
    assert _front_end_modules(with_tiny_tokenizer(tiny_llama_dir("llama")), str(tmp_path)) == "[]"


def _maps_torch(pid: int) -> bool:
    with open(f"/proc/{pid}/maps") as f:
        return "libtorch" in f.read()


def test_a_serving_server_holds_torch_in_the_scheduler_only(shared_smollm2_server):
    """The process tree of a real `radixserve serve` (torch is a shared library: it shows in the maps)."""
    front = shared_smollm2_server.proc.pid
    children = child_pids(front)
    kinds = {}
    for pid in children:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            kinds[f.read().split(b"\0")[-2].decode()] = pid
    assert set(kinds) == {"scheduler", "detokenizer"}, kinds
    assert not _maps_torch(front) and not _maps_torch(kinds["detokenizer"])
    assert _maps_torch(kinds["scheduler"])


def test_device_auto_is_cpu_without_importing_a_cpu_build_of_torch():
    code = "import sys; from radixserve.config import Config; print(Config().runtime.resolved_device(), 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    import torch

    if torch.version.cuda is None and torch.version.hip is None:
        assert out.stdout.split() == ["cpu", "False"], out.stderr
    else:  # a GPU build: torch decides
        assert out.stdout.split()[0] == ("cuda" if torch.cuda.is_available() else "cpu")


def _fake_torch(tmp_path, monkeypatch, cuda: str, hip: str) -> None:
    """`importlib.util.find_spec("torch")` finds a torch package whose version.py says `cuda`, `hip`
    (and whose import fails: the probe must not import it)."""
    import importlib.machinery
    import importlib.util

    pkg = tmp_path / "torch"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise ImportError('the probe must not import torch')\n")
    (pkg / "version.py").write_text(f"from typing import Optional\ncuda: Optional[str] = {cuda}\nhip: Optional[str] = {hip}\n")
    spec = importlib.machinery.ModuleSpec("torch", None, is_package=True)
    spec.submodule_search_locations = [str(pkg)]
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: spec if name == "torch" else real(name, *a))


@pytest.mark.parametrize(
    ("cuda", "hip", "driver", "certain"),
    [
        ("None", "None", True, True),  # a CPU build
        ("'12.4'", "None", False, True),  # a CUDA build on a machine without the driver
        ("'12.4'", "None", True, False),  # a CUDA build with a driver: ask torch
        ("None", "'6.2'", False, False),  # ROCm drives AMD GPUs without libcuda: ask torch
    ],
)
def test_the_cuda_probe_is_certain_only_where_torch_would_say_no(tmp_path, monkeypatch, cuda, hip, driver, certain):
    _fake_torch(tmp_path, monkeypatch, cuda, hip)
    import ctypes

    def cdll(name, *args, **kwargs):
        if not driver:
            raise OSError(f"{name}: cannot open shared object file")
        return object()

    monkeypatch.setattr(ctypes, "CDLL", cdll)
    assert torch_cannot_use_cuda() is certain


def test_an_explicit_device_is_kept():
    assert Config.build({"runtime": {"device": "cuda"}}).runtime.resolved_device() == "cuda"
