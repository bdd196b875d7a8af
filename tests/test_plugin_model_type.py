"""A model plugin whose checkpoints have their own model_type (docs/plugin-authoring.md, "A new
model_type"): the documented plugin (its config registered with AutoConfig inside
radixserve_register) is picked up, and without it start-up names the model_type and that
registration instead of transformers' "pip install --upgrade transformers"."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from plugin_fixtures import run_cli
from radixserve.model_loader.sources import ModelSource
from radixserve.testing import tiny_checkpoint

DOC = Path(__file__).resolve().parents[1] / "docs" / "plugin-authoring.md"
def _doc_block(first_line: str) -> str:
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    return next(b for b in blocks if b.startswith(first_line))


@pytest.fixture(scope="module")
def foo(tmp_path_factory) -> tuple[Path, str, str]:
    """(site dir holding the documented plugin, a foollama checkpoint, its llama twin)."""
    root = tmp_path_factory.mktemp("foo")
    site = root / "site"
    package = site / "radixserve_models_foo"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "config.py").write_text(_doc_block("# config.py of the package radixserve_models_foo"))
    (package / "plugin.py").write_text(_doc_block("# plugin.py of the package radixserve_models_foo"))
    (package / "model.py").write_text(_doc_block("# model.py of the package radixserve_models_foo"))
    info = site / "radixserve_models_foo-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: radixserve-models-foo\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text("[radixserve.plugins]\nfoo = radixserve_models_foo.plugin\n")
    ref = tiny_checkpoint("llama", str(root / "ref"))
    ckpt = root / "ckpt"
    shutil.copytree(ref, ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    config.update(model_type="foollama", architectures=["FooForCausalLM"])
    (ckpt / "config.json").write_text(json.dumps(config))
    return site, str(ckpt), ref


def test_an_unknown_model_type_names_the_registration_not_a_transformers_upgrade(foo):
    _, ckpt, _ = foo
    with pytest.raises(ValueError) as e:
        ModelSource(path=ckpt, format="safetensors").hf_config()
    msg = str(e.value)
    for piece in ("model_type 'foollama'", "AutoConfig.register('foollama', ", "radixserve_register",
                  "`radixserve plugins`"):
        assert piece in msg, (piece, msg)
    assert not msg.startswith("The checkpoint you are trying to load")  # transformers' own message
    assert "Transformers does not recognize" in str(e.value.__cause__)


def test_the_documented_plugin_serves_its_model_type(foo):
    site, ckpt, _ = foo
    shown = run_cli(["config", "show", "--model", ckpt], site=site)
    assert shown.returncode == 0, shown.stderr[-2000:]
    assert "native plugin 'foo'" in shown.stdout + shown.stderr, shown.stdout[-2000:]
    missing = run_cli(["config", "show", "--model", ckpt])  # the plugin not installed
    assert missing.returncode == 2 and "AutoConfig.register('foollama'" in missing.stderr, missing.stderr[-2000:]
    off = run_cli(["config", "show", "--model", ckpt, "-p", "no:foo"], site=site)
    assert off.returncode == 2 and "Traceback" not in off.stderr, off.stderr[-2000:]
    assert "installed plugins not loaded now: foo of radixserve-models-foo (plugins.disable)" in off.stderr


def test_the_documented_parity_test_runs_with_a_reference(foo, tmp_path, monkeypatch):
    site, _, _ = foo
    monkeypatch.syspath_prepend(str(site))
    namespace: dict = {}  # the block as pasted, its imports included (docs audit 31: it had none)
    exec(compile(_doc_block("# test_foo.py of the package"), f"{DOC}:test_foo", "exec"), namespace)
    namespace["test_foo"](tmp_path)
