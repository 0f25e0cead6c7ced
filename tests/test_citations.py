"""Citations: the repository explains itself.

Code, tests and the README cite the project's own docs as `docs/<file>.md#<anchor>`; every such
citation must name a file and a heading that exist, and no source file may cite a path outside
the repository (another machine's absolute path, or notes that were never part of the project).
"""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCE_DIRS = ("autotune", "api", "probes", "tests", "bench")
CITATION = re.compile(r"docs/([\w./-]+?\.md)(?:#([\w-]+))?")
# This file names them to find them, so it is the one file exempt from the check.
OUTSIDE_PATHS = re.compile(r"/work/|shared/reference|\b(feasibility|theory)\.md\b")


def _sources() -> list[Path]:
    files = [p for d in SOURCE_DIRS for p in sorted((ROOT / d).rglob("*.py"))]
    return [*files, ROOT / "README.md", ROOT / "Makefile", ROOT / "pyproject.toml"]


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading: lower case, punctuation dropped, spaces to
    hyphens (letters, digits, '_' and '-' kept)."""
    kept = "".join(
        c
        for c in heading.strip().lower()
        if c in " -_" or unicodedata.category(c)[0] in ("L", "N")
    )
    return kept.replace(" ", "-")


def anchors(markdown: str) -> set[str]:
    """Every heading's anchor; a repeated heading gets -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    found: set[str] = set()
    in_code = False
    for line in markdown.splitlines():
        if line.startswith("```"):
            in_code = not in_code
        match = None if in_code else re.match(r"#{1,6}\s+(.*)", line)
        if match is None:
            continue
        anchor = github_anchor(match.group(1))
        count = seen.get(anchor, 0)
        seen[anchor] = count + 1
        found.add(anchor if count == 0 else f"{anchor}-{count}")
    return found


def _citations() -> list[tuple[str, str, str | None]]:
    return [
        (f"{path.relative_to(ROOT)}:{number}", match.group(1), match.group(2))
        for path in _sources()
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        for match in CITATION.finditer(line)
    ]


def test_github_anchor() -> None:
    assert github_anchor("A real CPU out-of-memory is a signal, not a budget") == (
        "a-real-cpu-out-of-memory-is-a-signal-not-a-budget"
    )
    assert github_anchor("Tune: micro-batch × accumulation") == "tune-micro-batch--accumulation"
    assert anchors("# Top\n## Top\n```\n# not a heading\n```\n") == {"top", "top-1"}


def test_the_design_notes_are_cited() -> None:
    cited = {(doc, anchor) for _, doc, anchor in _citations()}
    for section in ("memory-model", "search", "loss-normalisation", "what-it-does-not-model"):
        assert ("design.md", section) in cited
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "](docs/design.md" in readme, "the README links the design notes"


@pytest.mark.parametrize(("where", "doc", "anchor"), _citations())
def test_every_citation_resolves(where: str, doc: str, anchor: str | None) -> None:
    path = ROOT / "docs" / doc
    assert path.is_file(), f"{where}: docs/{doc} does not exist"
    if anchor is not None:
        assert anchor in anchors(path.read_text(encoding="utf-8")), (
            f"{where}: docs/{doc} has no heading with anchor #{anchor}"
        )


def test_no_citation_leaves_the_repository() -> None:
    offenders = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path in _sources()
        if path != Path(__file__).resolve()
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if OUTSIDE_PATHS.search(line)
    ]
    assert offenders == []


def test_paths_named_in_the_docs_exist() -> None:
    repo_path = re.compile(r"`((?:autotune|api|probes|tests|bench)/[\w./]+)`")
    for doc in sorted((ROOT / "docs").glob("*.md")):
        for path in repo_path.findall(doc.read_text(encoding="utf-8")):
            assert (ROOT / path).exists(), f"{doc.name} names {path}, which does not exist"
