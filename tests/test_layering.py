"""The core's modules read top-down: no import (module level or inside a function) runs from a lower
layer up to a higher one. The layers are documented in docs/architecture.md ("Layers").

Imports under `if TYPE_CHECKING:` are annotations only (never executed) and are not counted."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

CORE = Path(importlib.util.find_spec("radixserve").origin).parent

# top (0) to bottom; a module belongs to the layer of its longest matching prefix
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("entry points", ("radixserve", "radixserve.cli", "radixserve.cli_serve", "radixserve.cli_generate",
                      "radixserve.engine", "radixserve.bench")),
    ("server", ("radixserve.server",)),
    ("runtime", ("radixserve.runtime",)),
    ("scheduler", ("radixserve.scheduler",)),
    ("executor", ("radixserve.model_runner", "radixserve.cuda_graph_runner", "radixserve.extend_graph_runner", "radixserve.tree_decode_rows", "radixserve.static_batch", "radixserve.tensor_parallel",
                  "radixserve.sampling", "radixserve.model_loader", "radixserve.tokenizer", "radixserve.serving_tokenizer")),
    ("layers", ("radixserve.layers", "radixserve.native")),
    ("memory", ("radixserve.memory", "radixserve.heap")),
    ("contracts", ("radixserve.interfaces", "radixserve.state", "radixserve.config", "radixserve.messages",
                   "radixserve.errors", "radixserve.logs", "radixserve.cpu_cores", "radixserve.validation", "radixserve.plugins", "radixserve.version", "radixserve.builtin_components")),
]


def layer_of(module: str) -> int | None:
    best: tuple[int, int] | None = None  # (prefix length, layer)
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and (best is None or len(p) > best[0]):
                best = (len(p), i)
    return None if best is None else best[1]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(CORE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING"
    )


def imported_modules(path: Path, source: str | None = None) -> list[tuple[int, str]]:
    """(line, module) of every radixserve import in the file, at any depth (functions included)."""
    module = module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[tuple[int, str]] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.extend((node.lineno, a.name) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for a in node.names:  # `from radixserve import native` imports the module radixserve.native
                sub = f"{target}.{a.name}"
                is_module = (CORE.parent / Path(*sub.split("."))).with_suffix(".py").exists() or (
                    CORE.parent / Path(*sub.split(".")) / "__init__.py"
                ).exists()
                found.append((node.lineno, sub if is_module else target))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text() if source is None else source, filename=str(path)))
    return [(line, m) for line, m in found if m == "radixserve" or m.startswith("radixserve.")]


MODULES = sorted(p for p in CORE.rglob("*.py") if "csrc" not in p.parts)


def test_every_core_module_has_a_layer():
    assert len(MODULES) > 50
    missing = [module_name(p) for p in MODULES if layer_of(module_name(p)) is None]
    assert not missing, f"place these modules in a layer (tests/test_layering.py, docs/architecture.md): {missing}"


def test_no_import_runs_from_a_lower_layer_up():
    violations = []
    for path in MODULES:
        here = layer_of(module_name(path))
        for line, target in imported_modules(path):
            there = layer_of(target)
            if there is not None and here is not None and there < here:
                violations.append(
                    f"{path.relative_to(CORE.parent)}:{line} ({LAYERS[here][0]}) imports {target} ({LAYERS[there][0]})"
                )
    assert not violations, "imports running back up the layers:\n" + "\n".join(sorted(set(violations)))


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("def f():\n    from radixserve.server.app import build_app\n", "radixserve.server.app"),
        ("from radixserve import native\n", "radixserve.native"),
        ("import radixserve.engine\n", "radixserve.engine"),
    ],
)
def test_the_checker_sees_lazy_and_package_imports(source, expected):
    assert [m for _, m in imported_modules(CORE / "memory" / "probe.py", source)] == [expected]


def test_type_checking_imports_are_not_counted():
    source = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from radixserve.engine import Engine\n"
    assert imported_modules(CORE / "memory" / "probe.py", source) == []
