"""The README is a front page and docs/ holds one page per topic: every relative link in them
points to a file that exists (and, with an anchor, to a heading of that file), every page of
docs/ is linked from the README, and the README stays short enough to read to the end."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]
MAX_README_LINES = 250

FENCE = re.compile(r"^(```|~~~)")
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[[^\]\n]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def prose_lines(path: Path) -> list[str]:
    """The file's lines outside fenced code blocks (a `# comment` in a bash block is no heading,
    a `[x](y)` in a code sample no link)."""
    lines, in_fence = [], False
    for line in path.read_text().splitlines():
        if FENCE.match(line.strip()):
            in_fence = not in_fence
            continue
        if not in_fence:
            lines.append(line)
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: the text as rendered (code spans and emphasis lose their
    marks, a link keeps its text), lower case, every character that is not a letter, a digit, a
    space, a hyphen or an underscore dropped, spaces turned into hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = text.replace("`", "").replace("*", "")
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every anchor the file's headings make; a repeated heading gets -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    found = set()
    for line in prose_lines(path):
        match = HEADING.match(line)
        if not match:
            continue
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def relative_links(path: Path) -> list[str]:
    links = []
    for line in prose_lines(path):
        for target in LINK.findall(INLINE_CODE.sub("", line)):
            if not re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                links.append(target)
    return links


def test_slug_follows_githubs_rule() -> None:
    assert slug("The step contract (scheduler -> engine)") == "the-step-contract-scheduler---engine"
    assert slug("GPU (`--device cuda`)") == "gpu---device-cuda"
    assert slug("Against llama.cpp") == "against-llamacpp"
    assert slug("Many replicas: data parallelism and routing") == (
        "many-replicas-data-parallelism-and-routing"
    )


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_points_to_something_that_exists(page: Path) -> None:
    broken = []
    for target in relative_links(page):
        file_part, _, anchor = target.partition("#")
        dest = (page.parent / file_part).resolve() if file_part else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading makes #{anchor} in {dest.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_every_docs_page_is_linked_from_the_readme() -> None:
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in relative_links(README)}
    missing = [str(p.relative_to(ROOT)) for p in DOCS if p.resolve() not in linked]
    assert not missing, f"pages of docs/ the README does not link: {missing}"


def test_readme_stays_a_front_page() -> None:
    num_lines = len(README.read_text().splitlines())
    assert num_lines <= MAX_README_LINES, (
        f"README.md has {num_lines} lines, the limit is {MAX_README_LINES}: move detail into a "
        "page of docs/ and link it"
    )
    text = README.read_text()
    for command in ("./quickstart.sh", "./test.sh"):
        assert command in text, f"the README's Quickstart lost {command}"
