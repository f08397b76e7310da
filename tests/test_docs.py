"""The README and docs/: the README stays short (at most 300 lines), the figures have their page
(docs/figures.md), and every relative markdown link in README.md and docs/*.md resolves: to a
file or folder that exists, and where it names an #anchor in a markdown file, to a heading of
that file (GitHub's slug). Pure file reading: no torch, no titan_rl."""

import re
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README_MAX_LINES = 300

# [text](target) or [text](target "title"); not images' sources in particular, but those must resolve too
LINK = re.compile(r"\[(?P<text>[^\]]*)\]\((?P<target>[^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1")


def markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def prose_lines(path: Path):
    """(line number, line) outside fenced code blocks."""
    fenced = False
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield number, line


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lowercase, every character that is not a
    letter, digit, underscore, hyphen or space removed, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text stays
    text = text.replace("`", "").replace("*", "")
    text = unicodedata.normalize("NFC", text).strip().lower()
    text = "".join(c for c in text if c.isalnum() or c in "_- ")
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading's anchor, duplicates numbered as GitHub numbers them (-1, -2, ...)."""
    seen: dict[str, int] = {}
    out = set()
    for _, line in prose_lines(path):
        m = HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(path: Path):
    """(line number, link target) of every markdown link outside code."""
    for number, line in prose_lines(path):
        for m in LINK.finditer(INLINE_CODE.sub("", line)):
            yield number, m.group("target")


def broken_links(path: Path, root: Path = ROOT) -> list[str]:
    """One line per broken link of `path`: the file and line, the link, what is wrong."""
    problems = []
    rel = path.relative_to(root)
    for number, target in links(path):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:, ...
            continue
        where, _, anchor = target.partition("#")
        dest = path if where == "" else (path.parent / where).resolve()
        shown = f"{rel}:{number}: link ({target})"
        if not dest.exists():
            problems.append(f"{shown}: {dest.relative_to(root) if dest.is_relative_to(root) else dest} does not exist")
            continue
        if anchor:
            if dest.suffix != ".md" or dest.is_dir():
                problems.append(f"{shown}: #{anchor} points into {dest.name}, which is not a markdown file")
            elif anchor not in anchors(dest):
                near = sorted(a for a in anchors(dest) if a[:6] == anchor[:6])
                problems.append(f"{shown}: {dest.relative_to(root)} has no heading whose anchor is "
                                f"#{anchor}" + (f" (close: {', '.join('#' + a for a in near)})" if near else ""))
    return problems


def test_readme_is_at_most_300_lines():
    n = len((ROOT / "README.md").read_text(encoding="utf-8").splitlines())
    assert n <= README_MAX_LINES, (f"README.md has {n} lines, more than {README_MAX_LINES}: move the "
                                   "detail to its docs/ page and the figures to docs/figures.md")


def test_the_figures_have_their_page():
    figures = ROOT / "docs" / "figures.md"
    assert figures.is_file(), "docs/figures.md is missing: the measured figures live there"
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "docs/figures.md" in readme, "README.md does not link docs/figures.md"


def test_the_readme_keeps_the_two_commands():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    for command in ("make train", "make test"):
        assert command in readme, f"README.md no longer shows `{command}`"
    assert "what CI runs" in readme, "README.md no longer says that `make test` is what CI runs"


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_resolves(path):
    problems = broken_links(path)
    assert not problems, f"{len(problems)} broken link(s) in {path.relative_to(ROOT)}:\n" + "\n".join(problems)


def test_the_slug_is_githubs():
    assert slug("Figures, by machine") == "figures-by-machine"
    assert slug("The execution contract (`titan_rl/contract.py`)") == "the-execution-contract-titan_rlcontractpy"
    assert slug("Layout invariance: the same gradients for any FSDP / TP layout") == \
        "layout-invariance-the-same-gradients-for-any-fsdp--tp-layout"
    assert slug("Quantization's cost on the EPYC") == "quantizations-cost-on-the-epyc"


def test_a_broken_link_is_found(tmp_path):
    """The checker itself: a missing file, a missing anchor and a good link, in a page of its own."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# A\n\n## Some heading\n\n```\n# not a heading\n```\n")
    page = tmp_path / "docs" / "b.md"
    page.write_text("[ok](a.md#some-heading) [gone](c.md) [no anchor](a.md#not-a-heading) "
                    "`[in code](x.md)`\n```\n[in a block](y.md)\n```\n[self](#b)\n# B\n")
    problems = broken_links(page, root=tmp_path)
    assert len(problems) == 2, problems
    assert "docs/b.md:1: link (c.md): docs/c.md does not exist" in problems[0]
    assert "docs/a.md has no heading whose anchor is #not-a-heading" in problems[1]
