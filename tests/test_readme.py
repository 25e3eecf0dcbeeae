"""The front door stays a front door: README.md is short, keeps the Hugging Face Spaces front matter, and
every relative link in it and in docs/*.md leads to a file (and, with an anchor, to a heading there); its
benchmark tables are the ones bench/run_all.py builds from bench/results/; CHANGELOG.md is dated, one line
an entry."""
from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
CODE_SPAN = re.compile(r"`[^`\n]*`")


def links(text: str) -> list[str]:
    """Markdown link and image targets outside code blocks and code spans."""
    text = CODE_SPAN.sub("", FENCE.sub("", text))
    return [m.group(1) for m in LINK.finditer(text)]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = CODE_SPAN.sub(lambda m: m.group(0)[1:-1], heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = FENCE.sub("", path.read_text())
    return {slug(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.+?)\s*$", text, re.M)}


def broken_links(path: Path) -> list[str]:
    """Each relative link of `path` that names no file, or an anchor no heading of its file has."""
    bad = []
    for target in links(path.read_text()):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            bad.append(f"{path.name}: {target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{path.name}: {target} (no such heading)")
    return bad


def test_link_check_catches_a_broken_link_and_a_bad_anchor(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "A.md").write_text("# A\n\n## The web app\n")
    page = tmp_path / "README.md"
    page.write_text("[ok](docs/A.md#the-web-app) [gone](docs/B.md) [anchor](docs/A.md#nowhere) "
                    "![img](pic.png) [web](https://example.com) `[code](docs/C.md)`\n"
                    "```\n[fenced](docs/D.md)\n```\n")
    assert broken_links(page) == ["README.md: docs/B.md (no such file)", "README.md: docs/A.md#nowhere (no such heading)",
                                  "README.md: pic.png (no such file)"]
    (tmp_path / "pic.png").write_bytes(b"")
    (tmp_path / "docs" / "B.md").write_text("# B\n")
    assert broken_links(page) == ["README.md: docs/A.md#nowhere (no such heading)"]


@pytest.mark.parametrize("path", [README, ROOT / "CHANGELOG.md", *DOCS], ids=lambda p: p.name)
def test_every_relative_link_resolves(path):
    assert broken_links(path) == []


def test_readme_links_every_doc():
    """A doc nobody links to is a doc nobody finds."""
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in links(README.read_text())}
    assert [d.name for d in DOCS if d not in linked] == []


def test_readme_is_short():
    assert len(README.read_text().splitlines()) < 200


def test_readme_keeps_the_spaces_front_matter():
    text = README.read_text()
    assert text.startswith("---\n")
    front = dict(line.split(": ", 1) for line in text.split("---\n")[1].strip().splitlines())
    for key in ("title", "emoji", "colorFrom", "colorTo", "sdk", "sdk_version", "python_version", "app_file",
                "hf_oauth", "pinned", "license", "short_description"):
        assert key in front, key
    assert front["sdk"] == "gradio"
    assert (ROOT / front["app_file"]).exists()
    pin = re.search(r"^gradio==(\S+)$", (ROOT / "requirements.txt").read_text(), re.M).group(1)
    assert front["sdk_version"] == pin  # a Space installs the sdk_version, not the pin
    assert len(front["short_description"]) <= 60  # the Hub's limit


def _table(path: Path) -> str:
    sys.path.insert(0, str(ROOT / "bench"))
    import run_all

    return path.read_text().split(run_all.START, 1)[1].split(run_all.END, 1)[0].strip()


def test_benchmark_tables_are_the_ones_run_all_builds():
    sys.path.insert(0, str(ROOT / "bench"))
    import run_all

    assert _table(ROOT / "docs" / "PERFORMANCE.md") == run_all.table()
    short = run_all.short_table()
    assert _table(README) == short
    assert 4 <= len(short.splitlines()) < len(run_all.table().splitlines())


def test_changelog_is_dated_one_line_an_entry():
    lines = (ROOT / "CHANGELOG.md").read_text().splitlines()
    sections = [line for line in lines if line.startswith("## ")]
    assert sections and all(re.fullmatch(r"## \d{4}-\d{2}-\d{2}", s) for s in sections), sections
    assert sections == sorted(sections, reverse=True)  # newest first
    entries = [line for line in lines if line.startswith("- ")]
    assert entries and all(len(e) <= 200 for e in entries), max(entries, key=len)
    # nothing but headings, entries and blank lines after the title
    assert all(not line or line.startswith(("#", "- ", "One line per change")) for line in lines)


def concept_paths(text: str) -> list[str]:
    """The repository paths the README's concept table names (code spans starting `app/` or `model_backend/`; a
    dotted attribute such as `app/engine/selection.check_selector` names its module)."""
    table = text[text.index("| concept | owner | used by |"):]
    table = table[:table.index("\n\n")]
    return [span for span in re.findall(r"`([^`\s]+)`", table) if re.match(r"^(app|model_backend)/", span)]


def test_every_path_the_concept_table_names_exists():
    paths = concept_paths(README.read_text())
    assert len(paths) >= 15  # the table is found and read
    missing = []
    for span in paths:
        module = re.sub(r"\.[a-z_]+$", "", span) if not span.endswith((".py", "/")) else span
        if not any((ROOT / p).exists() for p in (span, module, module + ".py")):
            missing.append(span)
    assert missing == []


def test_the_concept_check_catches_a_missing_path():
    text = "| concept | owner | used by |\n|---|---|---|\n| x | `app/no_such_module.py` | `app/store.py` |\n\n"
    assert [p for p in concept_paths(text) if not (ROOT / p).exists()] == ["app/no_such_module.py"]
