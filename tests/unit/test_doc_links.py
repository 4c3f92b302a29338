"""The README's and docs' relative links resolve.

Every relative markdown link and image in README.md and docs/**/*.md must name a file or
folder of this repository that exists; a ``#anchor`` into a markdown file (or into the page
itself) must name one of its headings, slugged as GitHub does. No link may leave the
repository by a relative path (``../shared/...`` and the like): the project describes its own
design. Links to other sites must go to public upstream projects over https. The README
stays short: at most 200 lines.
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

ROOT = Path(__file__).resolve().parents[2]
README_MAX_LINES = 200
# Sites a page may link to: public upstream projects and their registries.
UPSTREAM_HOSTS = {"github.com", "pypi.org", "grafana.com", "kubernetes.io", "keepachangelog.com"}

FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"(`+)(.+?)\1")
# [text](target "title") and ![alt](target); text may hold one level of brackets (e.g. `[x]`).
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"")


def pages() -> list[Path]:
    return [ROOT / "README.md"] + sorted((ROOT / "docs").rglob("*.md"))


def _prose(text: str) -> str:
    """The page with fenced code blocks and inline code blanked out (line breaks kept, so a
    match's offset still gives its line, and a link whose text wraps a line is still found)."""
    out, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            out.append("")
        elif fenced:
            out.append("")
        else:
            out.append(line)
    return INLINE_CODE.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), "\n".join(out))


def links(path: Path) -> list[tuple[int, str]]:
    """(line number, target) of every link and image of a markdown page."""
    prose = _prose(path.read_text(encoding="utf-8"))
    found = [(prose.count("\n", 0, m.start()) + 1, m.group(1)) for m in INLINE_LINK.finditer(prose)]
    for n, line in enumerate(prose.splitlines(), 1):
        m = REFERENCE_DEF.match(line)
        if m:
            found.append((n, m.group(1)))
    return found


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading's text: the rendered text (markup dropped), lower-cased,
    every character that is not a letter, digit, underscore, hyphen or space removed, spaces
    turned into hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)    # links and images: their text
    text = re.sub(r"<[^>]+>", "", text)                          # inline HTML
    text = text.replace("`", "")
    text = re.sub(r"(\*\*|\*|~~)", "", text)                     # emphasis markers
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every anchor a markdown page defines: its headings' slugs (a repeated slug gets -1, -2,
    ... as on GitHub) and explicit <a name/id> anchors."""
    seen: dict[str, int] = {}
    out = set()
    text = path.read_text(encoding="utf-8")
    for _, line in _prose_lines_keep_code(text):
        m = HEADING.match(line)
        if m:
            slug = github_slug(m.group(2))
            k = seen.get(slug, 0)
            seen[slug] = k + 1
            out.add(slug if k == 0 else f"{slug}-{k}")
        out.update(HTML_ANCHOR.findall(line))
    return out


def _prose_lines_keep_code(text: str) -> list[tuple[int, str]]:
    """Lines outside fenced code blocks, inline code kept (a heading's code is part of its slug)."""
    out, fenced = [], False
    for n, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            out.append((n, line))
    return out


def _inside(path: Path, root: Path) -> bool:
    try:
        path.relative_to(root)
        return True
    except ValueError:
        return False


def problems(page: Path, root: Path = ROOT) -> list[str]:
    """What is wrong with the links of `page`, a markdown file of the repository at `root`."""
    where = page.relative_to(root)
    out = []
    for n, target in links(page):
        if not target:
            out.append(f"{where}:{n}: empty link target")
            continue
        parts = urlsplit(target)
        if parts.scheme or target.startswith("//"):
            if parts.scheme == "mailto":
                continue
            host = (parts.hostname or "").lower()
            if parts.scheme != "https" or not any(host == h or host.endswith("." + h) for h in UPSTREAM_HOSTS):
                out.append(f"{where}:{n}: {target}: links leave the repository only to public upstream projects "
                           f"over https (hosts allowed: {', '.join(sorted(UPSTREAM_HOSTS))})")
            continue
        rel, anchor = unquote(parts.path), unquote(parts.fragment)
        if rel.startswith("/"):  # GitHub resolves these from the repository root
            dest = (root / rel.lstrip("/")).resolve()
        else:
            dest = (page.parent / rel).resolve() if rel else page
        if "shared/" in Path(rel).as_posix() and not _inside(dest, root):
            out.append(f"{where}:{n}: {target}: links to ../shared/, outside the repository")
            continue
        if not _inside(dest, root):
            out.append(f"{where}:{n}: {target}: points outside the repository ({dest})")
            continue
        if not dest.exists():
            out.append(f"{where}:{n}: {target}: {dest.relative_to(root)} does not exist")
            continue
        if anchor:
            if dest.is_file() and dest.suffix == ".md":
                if anchor.lower() not in anchors(dest):
                    out.append(f"{where}:{n}: {target}: no heading of {dest.relative_to(root)} has the anchor "
                               f"#{anchor}")
            elif not re.fullmatch(r"L\d+(-L\d+)?", anchor):
                out.append(f"{where}:{n}: {target}: #{anchor} into a file that is not markdown")
    return out


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    found = problems(page)
    assert not found, "broken links:\n" + "\n".join(found)


def _linked_pages(page: Path) -> set[Path]:
    out = set()
    for _, target in links(page):
        parts = urlsplit(target)
        if not parts.scheme and parts.path.endswith(".md"):
            out.add((page.parent / unquote(parts.path)).resolve())
    return out


def test_every_docs_page_is_reachable_from_the_readme() -> None:
    seen, todo = set(), [(ROOT / "README.md").resolve()]
    while todo:
        page = todo.pop()
        if page in seen or not page.is_file():
            continue
        seen.add(page)
        if page == (ROOT / "README.md").resolve() or (ROOT / "docs") in page.parents:
            todo += _linked_pages(page)
    orphans = [str(p.relative_to(ROOT)) for p in sorted((ROOT / "docs").rglob("*.md")) if p.resolve() not in seen]
    assert not orphans, f"docs pages no link from README.md leads to: {orphans}"


def test_readme_is_at_most_200_lines() -> None:
    n = len((ROOT / "README.md").read_text(encoding="utf-8").splitlines())
    assert n <= README_MAX_LINES, (f"README.md has {n} lines: it must stay at most {README_MAX_LINES} lines "
                                   "(a page for users); move details to a page under docs/ and link it")


# The checker itself, on cases whose answer is known.

def test_slugs_follow_github() -> None:
    assert github_slug("What `--role all` does") == "what---role-all-does"
    assert github_slug("DeepSeek-shaped models (MLA, MoE, NEXTN)") == "deepseek-shaped-models-mla-moe-nextn"
    assert github_slug("NEXTN (MTP)") == "nextn-mtp"
    assert github_slug("The [backends](backends.md) and **their** suite") == "the-backends-and-their-suite"


def test_the_checker_finds_what_is_broken(tmp_path: Path) -> None:
    root = tmp_path / "repo"
    (root / "docs").mkdir(parents=True)
    (root / "docs" / "a.md").write_text("# Title\n\n## Two words\n\n## Two words\n")
    page = root / "README.md"
    page.write_text(
        "[ok](docs/a.md#two-words) [dup](docs/a.md#two-words-1) [self](#top)\n"
        "![img](docs/missing.png) [gone](docs/a.md#nope) [out](../shared/DESIGN.md)\n"
        "`[code](nowhere.md)` [web](https://github.com/sgl-project/sglang) [private](http://10.0.0.1/x)\n"
        "```\n[fenced](nowhere.md)\n```\n<a name=\"top\"></a>\n"
        "a link whose [text\nwraps](docs/wrapped.md) a line\n")
    found = "\n".join(problems(page, root))
    assert "docs/missing.png does not exist" in found
    assert "#nope" in found
    assert "../shared/" in found
    assert "http://10.0.0.1/x" in found
    assert "README.md:8: docs/wrapped.md" in found  # the line the link starts on
    for fine in ("#two-words)", "#two-words-1", "#top", "nowhere.md", "sgl-project/sglang"):
        assert fine not in found, (fine, found)
