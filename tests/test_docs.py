"""The README stays a page a newcomer can scan, and every link in it and in docs/ leads somewhere: a policy that
moved out of the README keeps a working link."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\]\(([^)#\s]+)(#[^)\s]*)?\)")


def pages() -> list[Path]:
    return [ROOT / "README.md", ROOT / "bench" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def broken_links(page: Path) -> list[str]:
    """`page -> target` for each relative link whose file does not exist (anchors are not checked)."""
    return [f"{page.name} -> {target}" for target, _ in LINK.findall(page.read_text())
            if "://" not in target and not (page.parent / target).exists()]


def test_every_relative_link_resolves() -> None:
    assert [b for p in pages() for b in broken_links(p)] == []


def test_the_link_check_sees_a_broken_link(tmp_path: Path) -> None:
    page = tmp_path / "p.md"
    page.write_text("[a](missing.md) [b](p.md#top) [c](https://example.org/x)")
    assert broken_links(page) == ["p.md -> missing.md"]


def test_the_readme_is_short_and_points_at_the_rest() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.split()) <= 1300
    for page in ("docs/reference.md", "docs/prompts.md", "docs/engines.md", "docs/compose.md", "docs/scale-out.md",
                 "docs/replay.md", "docs/serving.md", "docs/export.md", "bench/README.md"):
        assert f"]({page})" in readme, page
    for term in ("**run**", "**shard**", "**fingerprint**", "**ledger**", "**dead letter**", "**τ**"):
        assert term in readme, term
