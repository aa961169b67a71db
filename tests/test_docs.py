"""The documents: every relative link in README.md and docs/*.md points to a file that exists
and, with an anchor, to a heading in it (GitHub's anchors), so the README and docs render with
working links. Reads Markdown only; imports nothing of gadei."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

_FENCE = re.compile(r"^(```|~~~)")
_LINK = re.compile(r"(?<!!)\[(?:[^\]]|\][^(])*?\]\(([^)\s]+)\)")  # [text](target), not ![image](...)
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def _prose(path: Path) -> list[tuple[int, str]]:
    """The lines of `path` outside fenced code blocks, with their numbers."""
    lines, fenced = [], False
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if _FENCE.match(line.lstrip()):
            fenced = not fenced
        elif not fenced:
            lines.append((number, line))
    return lines


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, markup and punctuation other than '-' and '_'
    dropped, each space a '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    text = text.lower().replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading's anchor in `path`; a repeated heading gets -1, -2... as on GitHub."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    for _, line in _prose(path):
        match = _HEADING.match(line)
        if match:
            base = anchor(match.group(2))
            n = seen.get(base, 0)
            found.add(base if n == 0 else f"{base}-{n}")
            seen[base] = n + 1
    return found


def links(path: Path) -> list[tuple[int, str]]:
    """The relative link targets of `path` (not http(s):, mailto:), with their line numbers."""
    found = []
    for number, line in _prose(path):
        line = re.sub(r"`[^`]*`", "", line)  # code spans hold no links
        for target in _LINK.findall(line):
            if not re.match(r"^[a-z][a-z0-9+.-]*:", target):
                found.append((number, target))
    return found


def test_the_documents_are_there():
    assert (ROOT / "README.md").is_file()
    assert (ROOT / "docs" / "README.md").is_file()


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(document):
    broken = []
    for number, target in links(document):
        file_part, _, fragment = target.partition("#")
        linked = (document.parent / file_part).resolve() if file_part else document
        where = f"{document.relative_to(ROOT)}:{number}: {target}"
        if not linked.exists():
            broken.append(f"{where}: no file {file_part}")
        elif fragment and linked.suffix == ".md" and fragment not in anchors(linked):
            broken.append(f"{where}: no heading with anchor #{fragment} in {linked.relative_to(ROOT)}")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_every_docs_file_is_in_the_index():
    index = ROOT / "docs" / "README.md"
    linked = {(index.parent / target.partition("#")[0]).resolve() for _, target in links(index)}
    missing = [p.name for p in DOCUMENTS if p.parent == index.parent and p != index and p.resolve() not in linked]
    assert not missing, f"docs/README.md does not link {', '.join(missing)}"


def test_the_anchor_rules():
    assert anchor("kernel: `gadei bench kernel --repeats 3`") == "kernel-gadei-bench-kernel---repeats-3"
    assert anchor("Protocol promises (each is a test)") == "protocol-promises-each-is-a-test"
    assert anchor("Job files: `gadei run`, `gadei predict` and the daemon") == \
        "job-files-gadei-run-gadei-predict-and-the-daemon"
