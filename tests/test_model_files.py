"""Where a model comes from: a local path, a Hugging Face Hub id (`org/name[@revision]`) served
from the local HF cache when offline, or a clear error naming the id, the cache and HF_HUB_OFFLINE.

There is no network in CI: the "Hub" is a temporary HF cache laid out as huggingface_hub writes it
(models--org--name/{refs,snapshots}), and "no network" is an endpoint on a closed local port."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys

import pytest
from radixserve.model_loader.model_files import parse_hub_id, resolve_model_path, served_name

COMMIT_MAIN = "a" * 40
COMMIT_V1 = "b" * 40


def _closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"  # closed once the socket is: connections are refused


def _place_snapshot(cache: str, repo_id: str, src: str, commit: str, ref: str) -> str:
    repo = os.path.join(cache, "models--" + repo_id.replace("/", "--"))
    snap = os.path.join(repo, "snapshots", commit)
    shutil.copytree(src, snap)
    os.makedirs(os.path.join(repo, "refs"), exist_ok=True)
    with open(os.path.join(repo, "refs", ref), "w") as f:
        f.write(commit)
    return snap


@pytest.fixture
def hf_cache(tmp_path, monkeypatch):
    """An empty HF cache for this test, seen by huggingface_hub in this process and in children."""
    from huggingface_hub import constants

    cache = str(tmp_path / "hf-cache")
    os.makedirs(cache)
    monkeypatch.setenv("HF_HUB_CACHE", cache)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", cache)  # read once at import by huggingface_hub
    return cache


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture
def unreachable_hub(monkeypatch):
    from huggingface_hub import constants

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    url = _closed_port_url()
    monkeypatch.setenv("HF_ENDPOINT", url)
    monkeypatch.setattr(constants, "ENDPOINT", url)


def test_hub_ids_and_paths_are_told_apart():
    assert parse_hub_id("HuggingFaceTB/SmolLM2-135M-Instruct") == ("HuggingFaceTB/SmolLM2-135M-Instruct", None)
    assert parse_hub_id("org/name@v1.0") == ("org/name", "v1.0")
    for path in ("/abs/model", "./org/name", "../org/name", "a/b/c", "org/model.gguf", "name", "org/a--b", "~/m/x"):
        assert parse_hub_id(path) is None, path


def test_hub_id_resolves_to_the_cached_snapshot_offline(tiny_llama_dir, hf_cache, offline):
    src = tiny_llama_dir("llama")
    main = _place_snapshot(hf_cache, "testorg/tiny-llama", src, COMMIT_MAIN, "main")
    v1 = _place_snapshot(hf_cache, "testorg/tiny-llama", src, COMMIT_V1, "v1")
    assert resolve_model_path("testorg/tiny-llama") == main
    assert resolve_model_path("testorg/tiny-llama@v1") == v1
    assert served_name(main, None) == "testorg/tiny-llama"  # not the commit hash
    assert served_name(main, "mine") == "mine"


def test_hub_id_missing_offline_names_the_id_the_cache_and_hf_hub_offline(hf_cache, offline):
    with pytest.raises(FileNotFoundError) as e:
        resolve_model_path("HuggingFaceTB/SmolLM2-135M-Instruct")
    msg = str(e.value)
    assert "HuggingFaceTB/SmolLM2-135M-Instruct" in msg and hf_cache in msg and "HF_HUB_OFFLINE" in msg


def test_unreachable_hub_falls_back_to_the_cache(tiny_llama_dir, hf_cache, unreachable_hub):
    snap = _place_snapshot(hf_cache, "testorg/tiny-llama", tiny_llama_dir("llama"), COMMIT_MAIN, "main")
    assert resolve_model_path("testorg/tiny-llama") == snap
    with pytest.raises(FileNotFoundError) as e:
        resolve_model_path("testorg/not-cached")
    msg = str(e.value)
    assert "testorg/not-cached" in msg and hf_cache in msg and "could not be reached" in msg


def test_missing_local_path_says_it_does_not_exist(tmp_path):
    for path in (str(tmp_path / "no-such-model"), str(tmp_path / "a" / "b.gguf"), "./org/name"):
        with pytest.raises(FileNotFoundError, match="does not exist"):
            resolve_model_path(path)


def test_a_bin_only_checkpoint_is_refused_saying_how_to_convert_it(tmp_path):
    """Models audit 32: the refusal said "convert them" and nothing of how."""
    from radixserve.model_loader.sources import detect_format

    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ValueError, match=r"\.bin weights; only safetensors are supported: convert them once, e\.g\. "
                                         r"AutoModelForCausalLM\.from_pretrained\(DIR\)\.save_pretrained\(NEW_DIR\)"):
        detect_format(str(tmp_path))


def test_existing_path_and_default_model_resolve_to_themselves(tiny_llama_dir, smollm2_gguf_path):
    src = tiny_llama_dir("llama")
    assert resolve_model_path(src) == src
    assert resolve_model_path(None) == smollm2_gguf_path


def test_model_runner_loads_a_hub_id_from_the_offline_cache(tiny_llama_dir, hf_cache, offline):
    """`radixserve generate`, the bench and the scheduler load through ModelRunner: it takes the id."""
    from radixserve.config import Config
    from radixserve.model_runner import ModelRunner

    snap = _place_snapshot(hf_cache, "testorg/tiny-llama", tiny_llama_dir("llama"), COMMIT_MAIN, "main")
    cfg = Config.build({"model": {"path": "testorg/tiny-llama"}, "runtime": {"device": "cpu", "num_threads": 1},
                        "scheduler": {"max_total_tokens": 256, "max_running_requests": 2}})
    runner = ModelRunner(cfg, show_progress=False)
    assert runner.model_path == snap and runner.vocab_size == 512


def test_cli_names_the_missing_hub_id_without_a_traceback(hf_cache):
    env = {**os.environ, "HF_HUB_CACHE": hf_cache, "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "radixserve.cli", "generate", "--model", "testorg/not-downloaded", "hi"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert "testorg/not-downloaded" in done.stderr and hf_cache in done.stderr and "HF_HUB_OFFLINE" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_model_file_that_is_not_gguf_asks_for_model_tokenizer(tmp_path):
    """A plugin weight source reads its own file format (say `model.rsw`), but the tokenizer comes
    from model.tokenizer: without it the error must say so (transformers said only "not a valid
    JSON file" about the weights)."""
    from radixserve.testing import tiny_tokenizer
    from radixserve.tokenizer import load_tokenizer

    tiny_tokenizer().save_pretrained(tmp_path / "tok")
    weights = tmp_path / "model.rsw"
    weights.write_bytes(b"\xc8\x00 binary weights")
    with pytest.raises(ValueError, match=r"model.path .*model\.rsw.* is a file.*set model.tokenizer \(serve or generate --tokenizer\)"):
        load_tokenizer(str(weights))
    with pytest.raises(ValueError, match=r"model.tokenizer .* is a file"):
        load_tokenizer(str(tmp_path / "tok"), str(weights))
    assert load_tokenizer(str(weights), str(tmp_path / "tok")).encode("hello")


def test_generate_takes_the_tokenizer_as_serve_does(tiny_llama_dir, tmp_path):
    """`radixserve generate --tokenizer DIR` (serve had the flag; generate refused it as an
    unknown argument, so a weight-source file could be run only with model.tokenizer=DIR)."""
    from radixserve.testing import tiny_tokenizer

    tiny_tokenizer().save_pretrained(tmp_path / "tok")
    cmd = [sys.executable, "-m", "radixserve.cli", "generate", "--model", tiny_llama_dir("llama"), "--tokenizer",
           str(tmp_path / "tok"), "--no-chat", "--max-tokens", "3", "--stats", "hello"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    # --stats shows the start-up log, where a weight source says which path its file took (GGUF audit 33)
    assert "radixserve.model_runner: stack: attention" in done.stderr, done.stderr[-2000:]


def _broken_models(root, gguf: str) -> dict[str, tuple[str, str]]:
    """name -> (path, what the one-line error must say)."""
    import pathlib

    root = pathlib.Path(root)
    for d, text in (("nocfg", None), ("badjson", '{"model_type": "llama",'), ("nomt", '{"hidden_size": 4}'),
                    ("bigsize", '{"model_type": "llama", "hidden_size": "big"}'),
                    ("baddtype", '{"model_type": "llama", "torch_dtype": "float33"}')):
        (root / d).mkdir()
        if text is not None:
            (root / d / "config.json").write_text(text)
    (root / "x.gguf").write_bytes(b"")
    (root / "t.gguf").write_bytes(pathlib.Path(gguf).read_bytes()[:1000])
    return {
        "nocfg": (str(root / "nocfg"), "has no config.json"),
        "badjson": (str(root / "badjson"), r"badjson/config.json is not valid JSON"),
        "nomt": (str(root / "nomt"), r"nomt/config.json has no model_type"),
        "bigsize": (str(root / "bigsize"), r"hidden_size must be an integer, got 'big'"),
        # models audit 30: a 35-line AttributeError traceback from transformers, exit 1
        "baddtype": (str(root / "baddtype"), r"torch_dtype 'float33' is not a torch dtype"),
        "empty": (str(root / "x.gguf"), r"x.gguf is not a valid GGUF file \(empty\)"),
        "truncated": (str(root / "t.gguf"), r"t.gguf is not a valid GGUF file \(truncated"),
    }


def test_broken_model_files_are_one_line_naming_the_file_in_generate_and_serve(tmp_path, smollm2_gguf_path):
    import re

    for name, (path, said) in _broken_models(tmp_path, smollm2_gguf_path).items():
        cmds = [["generate", "--model", path, "hi"]]
        if name in ("nomt", "truncated", "baddtype"):  # serve went to the scheduler (a traceback, a tokenizer error)
            cmds.append(["serve", "--model", path])
        for cmd in cmds:
            done = subprocess.run([sys.executable, "-m", "radixserve.cli", *cmd], capture_output=True, text=True,
                                  timeout=300)
            assert done.returncode == 2, (cmd, done.stderr[-3000:])
            assert re.search(said, done.stderr), (cmd, done.stderr[-3000:])
            assert "Traceback" not in done.stderr and "sentencepiece" not in done.stderr, done.stderr[-3000:]


def test_serve_names_a_missing_model_path_as_the_cli_names_bad_values(tmp_path):
    """`serve --model /no/such/dir` printed a log line ("13:00:02 ERROR radixserve.server: ..."); every
    other bad value is one `radixserve: error:` line."""
    missing = str(tmp_path / "no-such-model")
    done = subprocess.run([sys.executable, "-m", "radixserve.cli", "serve", "--model", missing, "--port", "0"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip().splitlines()[-1] == f"radixserve: error: model path {missing!r} does not exist"


def test_engine_with_broken_model_files_raises_a_clear_value_error(tmp_path, smollm2_gguf_path):
    from radixserve.engine import Engine

    for path, said in _broken_models(tmp_path, smollm2_gguf_path).values():
        with pytest.raises(ValueError, match=said):
            Engine(model=path, runtime={"device": "cpu"})
