"""Every relative link in README.md and docs/*.md resolves: the file exists, and a ``#anchor``
names a heading of the file it points into (GitHub's heading ids). Links in code are not links."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
INLINE_CODE = re.compile(r"`[^`\n]*`")
EXTERNAL = ("http://", "https://", "mailto:")


def slug(heading: str) -> str:
    """GitHub's id for a heading: its text lower-cased, punctuation dropped, spaces as ``-``."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def anchors(markdown: str) -> set[str]:
    """The ids of ``markdown``'s headings; a repeated id gets ``-1``, ``-2``, ... as on GitHub."""
    found: set[str] = set()
    for line in FENCE.sub("", markdown).splitlines():
        if match := re.match(r"#{1,6} (.+?)\s*#*\s*$", line):
            base = slug(match.group(1))
            name, n = base, 0
            while name in found:
                n += 1
                name = f"{base}-{n}"
            found.add(name)
    return found


def links(markdown: str) -> list[str]:
    """The targets of ``markdown``'s links and images, outside code."""
    text = INLINE_CODE.sub("", FENCE.sub("", markdown))
    return [m.group(1) for m in LINK.finditer(text)]


def broken_links(doc: Path) -> list[str]:
    """Each relative link of ``doc`` that does not resolve, with the reason."""
    broken = []
    for target in links(doc.read_text()):
        if target.startswith(EXTERNAL):
            continue
        path_part, _, anchor = target.partition("#")
        path = (doc.parent / path_part).resolve() if path_part else doc
        if not path.exists():
            broken.append(f"{target}: no such file")
        elif anchor and path.suffix == ".md" and anchor not in anchors(path.read_text()):
            broken.append(f"{target}: no heading #{anchor} in {path.name}")
    return broken


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(doc: Path) -> None:
    assert broken_links(doc) == []


def test_every_doc_is_linked_from_the_readme() -> None:
    readme = {target.partition("#")[0] for target in links((ROOT / "README.md").read_text())}
    assert {f"docs/{p.name}" for p in DOCS[1:]} - readme == set()


def test_the_slugs_are_githubs() -> None:
    assert slug("`pagestream up`") == "pagestream-up"
    assert slug("Against vLLM 0.26, in the same session") == "against-vllm-026-in-the-same-session"
    assert slug("Prefix caching, offload and swap") == "prefix-caching-offload-and-swap"
    assert slug("H100 (2026-11-25): the int8 paths") == "h100-2026-11-25-the-int8-paths"
    assert anchors("# A\n## A\n```\n# not a heading\n```\n## A\n") == {"a", "a-1", "a-2"}


def test_the_checker_catches_a_missing_file_and_a_missing_anchor(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# Other\n\n## Real heading\n")
    doc = tmp_path / "doc.md"
    doc.write_text(
        "# Doc\n\n[ok](other.md#real-heading) [self](#doc) `[code](nowhere.md)`\n"
        "[gone](missing.md) [bad](other.md#no-such-heading) [web](https://example.com/x)\n"
    )
    assert broken_links(doc) == [
        "missing.md: no such file",
        "other.md#no-such-heading: no heading #no-such-heading in other.md",
    ]
