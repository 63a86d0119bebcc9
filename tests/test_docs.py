"""The user docs (README.md, docs/*.md) and the raw results they cite (docs/results/).

- every file under docs/results/ (INDEX.md aside) is cited by README.md or a docs/*.md page, and is
  listed in docs/results/INDEX.md; every docs/results path cited anywhere exists;
- links between the pages point at files and headings that exist;
- the pages stay small (docs/*.md under 60 KB together, README.md under 8 KB) and speak of the
  product, not of how it was made (no session, work-item or dated-run narrative).

A citation is a path written as ``docs/results/...`` (or ``results/...`` inside docs/), with brace
alternatives allowed (``bench/x_h200.{log,json}``) and shell globs, which must match a file.
"""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

DOCS_LIMIT = 60_000  # bytes, docs/*.md together
README_LIMIT = 8_000  # bytes
NARRATIVE = re.compile(
    r"\b[Ss]ession[ -]?\d+|\bs\d{1,2}(?:_\w+)?\.sh\b|\b[Ii]ssue \d+|\bwork period|\blever run of"
    r"|results/s\d+/|\b20\d\d-\d\d-\d\d\b"
)
CITE = re.compile(r"(?<![\w./-])(?:docs/)?results/[\w./{},*-]+")
LINK = re.compile(r"\]\(([^)\s]+)\)")


def expand(pattern: str) -> list[str]:
    """``a{b,c}d`` -> ``abd``, ``acd`` (nested and repeated braces too)."""
    m = re.search(r"\{([^{}]*)\}", pattern)
    if not m:
        return [pattern]
    return [x for alt in m.group(1).split(",") for x in expand(pattern[: m.start()] + alt + pattern[m.end():])]


def user_pages(root: Path) -> list[Path]:
    return [root / "README.md"] + sorted((root / "docs").glob("*.md"))


def result_files(root: Path) -> set[str]:
    res = root / "docs" / "results"
    return {p.relative_to(res).as_posix() for p in res.rglob("*") if p.is_file() and p.name != "INDEX.md"}


def citations(text: str) -> list[str]:
    """Paths relative to docs/results/ that the text cites."""
    out = []
    for m in CITE.finditer(text):
        raw = m.group(0).rstrip(".,")
        rel = raw.split("results/", 1)[1]
        out.extend(expand(rel))
    return out


def resolve(pattern: str, files: set[str]) -> set[str]:
    if any(c in pattern for c in "*?["):
        return {f for f in files if fnmatch.fnmatchcase(f, pattern)}
    return {pattern} & files


def check_citations(root: Path) -> list[str]:
    files = result_files(root)
    res = root / "docs" / "results"
    problems, cited = [], set()
    index = res / "INDEX.md"
    for page in user_pages(root) + [index]:
        if not page.exists():
            problems.append(f"{page.relative_to(root)} is missing")
            continue
        for rel in citations(page.read_text()):
            if rel == "" or rel.endswith("/") or (res / rel).is_dir():
                if not (res / rel).is_dir():
                    problems.append(f"{page.relative_to(root)} cites a missing folder docs/results/{rel}")
                continue
            hit = resolve(rel, files) or ({rel} if rel == "INDEX.md" and index.exists() else set())
            if not hit:
                problems.append(f"{page.relative_to(root)} cites docs/results/{rel}, which does not exist")
            if page != index:
                cited |= hit
    for f in sorted(files - cited):
        problems.append(f"docs/results/{f} is cited by no page (README.md, docs/*.md)")
    if index.exists():
        listed = set()
        for tok in re.findall(r"`([^`\s]+)`", index.read_text()):
            for rel in expand(tok):
                listed |= resolve(rel, files)
        for f in sorted(files - listed):
            problems.append(f"docs/results/{f} is not listed in docs/results/INDEX.md")
    return problems


def slug(heading: str) -> str:
    h = heading.strip().lower().replace("`", "")
    return re.sub(r"[^\w\- ]", "", h).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    return {slug(line.lstrip("#")) for line in path.read_text().splitlines() if line.startswith("#")}


def check_links(root: Path) -> list[str]:
    problems = []
    for page in user_pages(root) + [root / "docs" / "results" / "INDEX.md"]:
        if not page.exists():
            continue
        for target in LINK.findall(page.read_text()):
            if re.match(r"[a-z]+://|mailto:", target):
                continue
            file, _, anchor = target.partition("#")
            dest = (page.parent / file).resolve() if file else page
            if not dest.exists():
                problems.append(f"{page.relative_to(root)} links to {target}: no such file")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                problems.append(f"{page.relative_to(root)} links to {target}: no such heading")
    return problems


def check_sizes(root: Path) -> list[str]:
    problems = []
    docs = sum(p.stat().st_size for p in (root / "docs").glob("*.md"))
    if docs >= DOCS_LIMIT:
        problems.append(f"docs/*.md are {docs} bytes together, the limit is {DOCS_LIMIT}")
    readme = (root / "README.md").stat().st_size
    if readme >= README_LIMIT:
        problems.append(f"README.md is {readme} bytes, the limit is {README_LIMIT}")
    return problems


def check_narrative(root: Path) -> list[str]:
    problems = []
    for page in user_pages(root) + [root / "docs" / "results" / "INDEX.md"]:
        if not page.exists():
            continue
        for n, line in enumerate(page.read_text().splitlines(), 1):
            for m in NARRATIVE.finditer(line):
                problems.append(f"{page.relative_to(root)}:{n}: {m.group(0)!r} (history belongs in git)")
    return problems


def test_every_result_is_cited_and_every_citation_exists():
    assert check_citations(ROOT) == []


def test_links_between_pages_resolve():
    assert check_links(ROOT) == []


def test_pages_are_small():
    assert check_sizes(ROOT) == []


def test_pages_tell_no_work_history():
    assert check_narrative(ROOT) == []


def test_the_checks_can_fail(tmp_path):
    (tmp_path / "docs" / "results" / "bench").mkdir(parents=True)
    (tmp_path / "docs" / "results" / "bench" / "a_h200.log").write_text("x")
    (tmp_path / "docs" / "results" / "bench" / "b_h200.log").write_text("x")
    (tmp_path / "docs" / "results" / "INDEX.md").write_text("`bench/a_h200.log`\n")
    (tmp_path / "README.md").write_text("See [perf](docs/p.md#nope). Run of session 12.\n" + "x" * 8000)
    (tmp_path / "docs" / "p.md").write_text("# P\n`docs/results/bench/{a,c}_h200.log`\n")
    cit = check_citations(tmp_path)
    assert any("bench/c_h200.log, which does not exist" in p for p in cit)
    assert any("bench/b_h200.log is cited by no page" in p for p in cit)
    assert any("bench/b_h200.log is not listed" in p for p in cit)
    assert not any("a_h200.log" in p for p in cit)
    assert any("no such heading" in p for p in check_links(tmp_path))
    assert any("README.md is" in p for p in check_sizes(tmp_path))
    assert any("session 12" in p for p in check_narrative(tmp_path))
