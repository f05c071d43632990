"""The documentation's promises: links that resolve, a short README, every training flag documented,
every docs page reachable from the README. Reads files only; loads no model."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
from effitrain import config as cfg

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
LINKED_FROM = [README, *DOCS, ROOT / "benchmarks" / "README.md", *sorted((ROOT / "benchmarks" / "results").glob("*.md"))]
MAX_README_LINES = 300

# [text](target) and ![alt](target); the target ends at whitespace or ")" (an optional "title" is ignored).
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)


def links(path: Path) -> list[str]:
    """The link targets of a markdown file, outside fenced code blocks."""
    return LINK.findall(FENCE.sub("", path.read_text(encoding="utf-8")))


def relative_targets(path: Path) -> list[tuple[str, Path]]:
    """(link as written, the file it points to) for every relative link: http(s), mailto and pure
    #anchors are left out, an #anchor or ?query on a file is dropped."""
    found = []
    for target in links(path):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("#"):
            continue
        file = target.split("#", 1)[0].split("?", 1)[0]
        found.append((target, (path.parent / file).resolve()))
    return found


@pytest.mark.parametrize("path", LINKED_FROM, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path):
    missing = [target for target, file in relative_targets(path) if not file.exists()]
    assert not missing, f"{path.relative_to(ROOT)} links to files that do not exist: {missing}"


def test_readme_is_short_and_starts_with_the_two_commands():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines; move the rest to docs/"
    top = "\n".join(lines[:30])
    assert "make demo" in top and "make test" in top, "README.md must show `make demo` and `make test` in its first 30 lines"


def test_every_train_flag_is_documented():
    """Each TrainConfig field is a flag of `effitrain train`, spelled --name-with-dashes in the docs.
    A field only a written config.yaml carries (metadata yaml_only: the resolved plan) has no flag; it
    must appear as its YAML key instead."""
    text = "\n".join(p.read_text(encoding="utf-8") for p in [README, *DOCS])
    missing = []
    for field in dataclasses.fields(cfg.TrainConfig):
        if field.metadata.get("yaml_only"):
            if not re.search(rf"`{field.name}:?`", text):
                missing.append(f"{field.name} (YAML key)")
        elif not re.search(rf"--{field.name.replace('_', '-')}(?![\w-])", text):
            missing.append("--" + field.name.replace("_", "-"))
    assert not missing, f"not in README.md or docs/*.md: {missing}"


def test_every_docs_page_is_linked_from_the_readme():
    linked = {file for _, file in relative_targets(README)}
    orphans = [p.name for p in DOCS if p.resolve() not in linked]
    assert DOCS, "docs/ holds no page"
    assert not orphans, f"docs pages README.md does not link to: {orphans}"


def documented_layout() -> set[str]:
    """The modules and packages the layout block of docs/architecture.md names, as paths under
    src/effitrain/ (`engine/strategies/fsdp.py`): nesting by indentation, two spaces a level."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = text.split("## Layout", 1)[1].split("```", 2)[1]
    named, folders = set(), []
    for line in block.splitlines()[1:]:
        if not line.strip() or line.strip() == "src/effitrain/":
            continue
        depth = (len(line) - len(line.lstrip(" "))) // 2 - 1
        entry = line.split()[0]
        folders = folders[:depth]
        path = "/".join([*folders, entry.rstrip("/")])
        named.add(path + ("/" if entry.endswith("/") else ""))
        if entry.endswith("/"):
            folders.append(entry.rstrip("/"))
    return named


def test_the_architecture_page_lists_every_module_of_the_tree_and_nothing_else():
    src = ROOT / "src" / "effitrain"
    in_tree = {p.relative_to(src).as_posix() for p in src.rglob("*.py") if p.name != "__init__.py" or p.parent == src}
    in_tree |= {p.parent.relative_to(src).as_posix() + "/" for p in src.rglob("__init__.py") if p.parent != src}
    named = documented_layout()
    assert named == in_tree, f"in the tree, not on the page: {sorted(in_tree - named)}; " \
                             f"on the page, not in the tree: {sorted(named - in_tree)}"
