"""The README and the Markdown docs: every relative link resolves inside the repository, and the
README stays a front page (at most 150 lines)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README_MAX_LINES = 150

# [text](target) and ![alt](target), with an optional "title"; text may hold nested brackets
# one level deep, as in [`code`](path) or [![badge](img)](url).
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
# [label]: target (reference-style definitions).
REFERENCE_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$", re.MULTILINE)
FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
INLINE_CODE = re.compile(r"`[^`\n]*`")
EXTERNAL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")  # http:, https:, mailto:, ...


def doc_files() -> list[Path]:
    files = [ROOT / "README.md", ROOT / "bench" / "README.md"]
    files += sorted((ROOT / "docs").glob("*.md"))
    files += sorted((ROOT / "bench" / "results").glob("*.md"))
    return [f for f in files if f.is_file()]


def link_targets(text: str) -> list[str]:
    """Link and image targets of a Markdown text, outside code blocks and inline code (whose
    brackets are not links)."""
    text = FENCE.sub("", text)
    text = INLINE_CODE.sub(lambda m: " " * len(m.group(0)), text)
    return INLINE_LINK.findall(text) + REFERENCE_DEF.findall(text)


def broken_links(path: Path, root: Path = ROOT) -> list[str]:
    """Relative targets in path that name nothing inside root (anchors and URLs skipped)."""
    broken = []
    for target in link_targets(path.read_text(encoding="utf-8")):
        if EXTERNAL.match(target) or target.startswith("#"):
            continue
        rel = target.split("#", 1)[0].split("?", 1)[0]
        resolved = (root / rel.lstrip("/")) if rel.startswith("/") else (path.parent / rel)
        resolved = resolved.resolve()
        if not resolved.is_relative_to(root.resolve()) or not resolved.exists():
            broken.append(target)
    return broken


def test_doc_files_found():
    names = {f.relative_to(ROOT).as_posix() for f in doc_files()}
    assert {"README.md", "bench/README.md", "bench/results/LATEST.md"} <= names
    assert any(n.startswith("docs/") for n in names)


@pytest.mark.parametrize("path", doc_files(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(path: Path):
    assert broken_links(path) == [], f"{path.relative_to(ROOT)} links to missing paths"


def test_readme_is_a_front_page():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES


def test_link_parser(tmp_path: Path):
    md = tmp_path / "a.md"
    (tmp_path / "b.md").write_text("")
    (tmp_path / "d").mkdir()
    md.write_text(
        "[ok](b.md#x) [dir](d/) ![img](missing.png) [web](https://example.com/x)\n"
        '[`code`](gone.md "title") [anchor](#top) `[not](a-link.md)`\n'
        "```\n[inside](fence.md)\n```\n[ref]: other.md\n"
    )
    targets = link_targets(md.read_text())
    assert targets == [
        "b.md#x",
        "d/",
        "missing.png",
        "https://example.com/x",
        "gone.md",
        "#top",
        "other.md",
    ]
    assert broken_links(md, root=tmp_path) == ["missing.png", "gone.md", "other.md"]
    (tmp_path / "sub").mkdir()
    outside = tmp_path / "sub" / "c.md"
    outside.write_text("[up](../b.md) [out](../../escape.md)")
    assert broken_links(outside, root=tmp_path / "sub") == ["../b.md", "../../escape.md"]
