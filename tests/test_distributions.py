"""Every plugin distribution in the tree stands on its own: its pyproject names a radixserve-*
distribution that depends on the core (and never on torch: the user's torch build is kept), exposes
an entry point in the `radixserve.plugins` group whose module exists in its package, and the
development install (requirements.txt, or requirements-test.txt for GPU-only ones, or
requirements-nodeps.txt for those whose own dependencies are CUDA-only packages) lists it. Installing one plugin with pip needs nothing else."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parent.parent
PYPROJECTS = sorted(p for p in (ROOT / "plugins").rglob("pyproject.toml") if ".egg-info" not in str(p))


def test_the_tree_has_the_session_distributions():
    names = {tomllib.loads(p.read_text())["project"]["name"] for p in PYPROJECTS}
    assert {"radixserve-models-deepseek", "radixserve-attention-mla_triton", "radixserve-spec-mtp",
            "radixserve-models-transformers", "radixserve-quant-gguf"} <= names


@pytest.mark.parametrize("pyproject", PYPROJECTS, ids=lambda p: str(p.parent.relative_to(ROOT)))
def test_plugin_distribution_is_installable_on_its_own(pyproject):
    project = tomllib.loads(pyproject.read_text())
    meta = project["project"]
    assert meta["name"].startswith("radixserve-"), meta["name"]
    deps = meta.get("dependencies", [])
    assert any(re.match(r"radixserve\s*(>|=|~|$)", d) for d in deps), f"{meta['name']} must depend on the core"
    assert not [d for d in deps if re.match(r"torch\b", d)], f"{meta['name']} must not pull its own torch"
    entry = project["project"]["entry-points"]["radixserve.plugins"]
    for module in entry.values():
        package = module.split(".")[0]
        assert (pyproject.parent / package).is_dir(), f"{meta['name']}: no package {package!r} beside its pyproject"
        assert importlib.util.find_spec(module) is not None, f"{meta['name']}: entry point module {module} not found"
    listed = "".join((ROOT / f).read_text() for f in ("requirements.txt", "requirements-test.txt",
                                                      "requirements-nodeps.txt"))
    assert f"./{pyproject.parent.relative_to(ROOT)}" in listed, f"the development install misses {meta['name']}"


def test_plugins_with_cuda_only_dependencies_are_installed_without_them():
    """requirements-nodeps.txt is installed with --no-deps (the CPU install must not download
    flashinfer-python and the CUDA packages it pulls), and nothing else installs those plugins."""
    makefile = (ROOT / "Makefile").read_text()
    assert "pip install -q --no-deps -r requirements-nodeps.txt" in makefile
    nodeps = [line.split("#", 1)[0].strip() for line in (ROOT / "requirements-nodeps.txt").read_text().splitlines()]
    paths = [line.removeprefix("-e ").strip() for line in nodeps if line]
    assert "./plugins/attention/flashinfer" in paths
    others = (ROOT / "requirements.txt").read_text() + (ROOT / "requirements-test.txt").read_text()
    for path in paths:
        assert path not in others, f"{path} would be installed with its dependencies"
    deps = tomllib.loads((ROOT / "plugins/attention/flashinfer/pyproject.toml").read_text())["project"]["dependencies"]
    assert any(d.startswith("flashinfer-python") for d in deps)  # what `pip install` of the plugin brings
