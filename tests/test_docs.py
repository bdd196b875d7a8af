"""The docs cannot drift from the code: docs/configuration.md documents exactly the keys of the
`Config` model (one table row per key, walked generically so new sections and keys are caught),
and README.md and docs/ point only to files that are in the repository, and to sections that exist."""

from __future__ import annotations

import fnmatch
import re
import subprocess
import types
import typing
from pathlib import Path

from pydantic import BaseModel
from radixserve.config import Config

ROOT = Path(__file__).resolve().parent.parent
CONFIG_DOC = ROOT / "docs" / "configuration.md"


def _nested_models(annotation) -> list[type[BaseModel]]:
    """The pydantic models inside an annotation (`Section`, `Section | None`, ...); a dict or list
    of models is one key, not a section."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return [m for arg in typing.get_args(annotation) for m in _nested_models(arg)]
    return []


def config_keys(model: type[BaseModel] = Config, prefix: str = "") -> set[str]:
    """Every settable dotted key of the model: `section.key`, `section.sub.key`, ..."""
    keys: set[str] = set()
    for name, field in model.model_fields.items():
        dotted = prefix + name
        nested = _nested_models(field.annotation)
        if nested:
            for sub in nested:
                keys |= config_keys(sub, dotted + ".")
        else:
            keys.add(dotted)
    return keys


def documented_keys(text: str) -> set[str]:
    """The backticked dotted keys in the first cell of the doc's table rows."""
    keys = set()
    for line in text.splitlines():
        cells = line.split("|")
        if line.startswith("|") and len(cells) > 2:
            keys |= set(re.findall(r"`([a-z_][a-z0-9_]*(?:\.[a-z0-9_]+)+)`", cells[1]))
    return keys


def test_walker_sees_nested_sections_and_optional_models():
    class Inner(BaseModel):
        depth: int = 0

    class Outer(BaseModel):
        plain: int = 0
        inner: Inner = Inner()
        maybe: Inner | None = None
        options: dict[str, int] = {}

    assert config_keys(Outer) == {"plain", "inner.depth", "maybe.depth", "options"}


def test_configuration_doc_has_one_row_per_config_key():
    keys = config_keys()
    assert {"model.path", "stack.policy", "scheduler.chunked_prefill_size", "server.port"} <= keys
    documented = documented_keys(CONFIG_DOC.read_text())
    missing = sorted(keys - documented)
    stale = sorted(documented - keys)
    assert not missing, f"docs/configuration.md has no row for {missing}: add one per key"
    assert not stale, f"docs/configuration.md documents keys the Config model does not have: {stale}"


# a repository path: at least one folder, or a Markdown file; `../` can only leave the repository
_PATH = re.compile(r"(?<![\w/.:-])((?:\.\.?/)*(?:[\w.*-]+/)+[\w*-][\w.*-]*\.(?:md|py|yaml|yml|sh|txt|toml|json|cpp)"
                   r"|[\w-]+\.md)(?![\w/])")


def test_readme_and_docs_point_only_to_files_in_the_repo():
    # committed or about to be (untracked but not ignored): never .venv/, .models/ or ../shared
    git = ["git", "ls-files", "--cached", "--others", "--exclude-standard"]
    tracked = subprocess.run(git, cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()

    def exists(ref: str) -> bool:
        if ref.startswith("../"):
            return False
        ref = ref.removeprefix("./")
        return any(fnmatch.fnmatch(f, ref) or fnmatch.fnmatch(f, "*/" + ref) for f in tracked)

    docs = _user_docs()
    dangling = [
        f"{doc.relative_to(ROOT)}:{i}: {m.group(1)}"
        for doc in docs
        for i, line in enumerate(doc.read_text().splitlines(), 1)
        for m in _PATH.finditer(line)
        if "://" not in line[max(0, m.start() - 40) : m.start()] and not exists(m.group(1))
    ]
    assert not dangling, "references to files that are not in the repository:\n" + "\n".join(dangling)


def _user_docs() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


# a Markdown link to a section: [text](file.md#anchor) or [text](#anchor)
_SECTION_LINK = re.compile(r"\]\(([^)\s#]*\.md)?#([^)\s]+)\)")


def _github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation but `-` and `_` dropped, spaces to `-`."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(doc: Path) -> set[str]:
    anchors, in_code = set(), False
    for line in doc.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and line.startswith("#"):
            anchors.add(_github_anchor(line.lstrip("#")))
    return anchors


def test_github_anchor_matches_githubs_rule():
    assert _github_anchor(" 8. Conformance kits (`radixserve.testing`)") == "8-conformance-kits-radixservetesting"
    assert _github_anchor("FP8 KV cache") == "fp8-kv-cache"


def test_links_to_doc_sections_name_existing_headings():
    # a renumbered or renamed section leaves links that open the page at its top (an outsider
    # following plugin-authoring.md to "the conformance kits" landed on contracts.md's first line)
    docs = _user_docs()
    broken = [
        f"{doc.relative_to(ROOT)}:{i}: {m.group(0)}"
        for doc in docs
        for i, line in enumerate(doc.read_text().splitlines(), 1)
        for m in _SECTION_LINK.finditer(line)
        if (target := doc.parent / m.group(1) if m.group(1) else doc).is_file()
        and m.group(2) not in _anchors(target)
    ]
    assert not broken, "links to sections that do not exist:\n" + "\n".join(broken)


def test_configuration_md_lists_every_peer_option():
    from radixserve.peer_options import PEER_OPTIONS

    doc = CONFIG_DOC.read_text()
    missing = [name for name, equivalent in PEER_OPTIONS.items() if f"`{name}=` | {equivalent} |" not in doc]
    assert not missing, f"docs/configuration.md's vLLM/SGLang table lacks {missing}"
