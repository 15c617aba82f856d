"""The docs stay true to the repository: README.md stays a guide, every relative link and every repository path the
README and docs/*.md write exists, and the table that opens docs/benchmarks.md quotes the sections below it and
names commands that exist. Text only: nothing here runs a command."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.conftest import ROOT

README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 250
REPO_DIRS = ("tasks/", "flows/", "lineage/", "lifecycle/", "bench/", "deploy/", "docs/", "tests/", "corpus/")
WRITTEN_BY_THE_READER = {
    "deploy/.env",                  # the user copies it from deploy/env.example (docs/operations.md)
    "tasks/data/langfix/stage.py",  # the worked example of docs/architecture.md, "How to add a stage"
    "tests/data/test_langfix.py",
}
PLACEHOLDER = re.compile(r"[<>*{}\[\]$]|\.\.\.")
BENCH_COLUMNS = ["figure", "value", "goal", "command", "date", "machine"]


def prose(text: str) -> str:
    """`text` without its fenced code blocks (a `# comment` in a bash block is no heading, `…` in it no code span)."""
    out, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            out.append(line)
    return "\n".join(out)


def anchors(page: Path) -> set[str]:
    """GitHub's heading ids: lower case, punctuation dropped, spaces to hyphens."""
    heads = re.findall(r"^#{1,6} +(.+?) *$", prose(page.read_text()), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in heads}


def links(page: Path) -> list[str]:
    return [t for t in re.findall(r"\]\(([^)\s]+)\)", prose(page.read_text())) if not re.match(r"[a-z]+:", t)]


def repo_paths(page: Path) -> list[str]:
    """Words of inline code that name a path of this repository, less placeholders (`<workdir>`, globs)."""
    out = []
    for span in re.findall(r"`([^`\n]+)`", prose(page.read_text())):
        for word in span.split():
            word = word.strip("(),;:").split("::")[0].rstrip(".")
            if word.startswith(REPO_DIRS) and not PLACEHOLDER.search(word):
                out.append(word)
    return out


def split_row(line: str) -> list[str]:
    return [cell.strip() for cell in re.split(r"(?<!\\)\|", line.strip().strip("|"))]


def opening_table(text: str) -> tuple[list[dict[str, str]], str]:
    """The rows of the first table of `text`, which must come before the first `## ` section, and the text after it."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    assert not any(line.startswith("## ") for line in lines[:start]), "docs/benchmarks.md must open with its table"
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    header, rule, *rows = lines[start:end]
    assert split_row(header) == BENCH_COLUMNS, f"columns: {split_row(header)}"
    assert set(rule) <= set("|-: "), rule
    return [dict(zip(BENCH_COLUMNS, split_row(row), strict=True)) for row in rows], "\n".join(lines[end:])


def named_files(command: str) -> list[str]:
    """The repository files a command names: `python -m bench.x` → bench/x.py, `make t` → Makefile, and every word
    that is a relative path of the repository (`bash bench/x.sh`, `pytest tests/...py`, `.ci/run`)."""
    words = command.strip("`").split()
    files = ["Makefile"] if words[:1] == ["make"] else []
    for i, word in enumerate(words):
        if word == "-m" and i + 1 < len(words) and words[i + 1].startswith("bench."):
            files.append(words[i + 1].replace(".", "/") + ".py")
        elif word.startswith((*REPO_DIRS, ".ci/")) or (word.endswith((".py", ".sh")) and not word.startswith("/")):
            files.append(word)
    return files


def test_the_readme_is_a_guide():
    n = len(README.read_text().splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines (at most {README_MAX_LINES}): move reference text to docs/"


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(ROOT).as_posix() for p in PAGES])
def test_relative_links_point_at_files_and_headings(page):
    broken = []
    for target in links(page):
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no file {file}")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{target}: no heading #{anchor} in {file.name}")
    assert not broken, f"{page.name}: " + "; ".join(broken)


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(ROOT).as_posix() for p in PAGES])
def test_repository_paths_in_code_exist(page):
    missing = sorted({p for p in repo_paths(page) if p not in WRITTEN_BY_THE_READER and not (ROOT / p).exists()})
    assert not missing, f"{page.name} names paths that are not in the repository (moved?): {missing}"


def test_the_benchmarks_table_quotes_its_sections_and_names_real_commands():
    rows, body = opening_table((ROOT / "docs" / "benchmarks.md").read_text())
    assert len(rows) >= 15
    body = " ".join(body.split())  # a value may be wrapped across lines in the sections
    problems = []
    for row in rows:
        name = row["figure"]
        if " ".join(row["value"].split()) not in body:
            problems.append(f"{name}: value {row['value']!r} is not in the sections below the table")
        files = named_files(row["command"])
        if not files:
            problems.append(f"{name}: command {row['command']} names no file of the repository")
        problems += [f"{name}: {f} does not exist" for f in files if not (ROOT / f).exists()]
        target = row["command"].strip("`").split()[1:2] if files[:1] == ["Makefile"] else []
        if target and not re.search(rf"^{re.escape(target[0])}:", (ROOT / "Makefile").read_text(), flags=re.M):
            problems.append(f"{name}: the Makefile has no target {target[0]}")
        if not re.fullmatch(r"\d{4}-\d\d-\d\d", row["date"]) or not row["machine"] or not row["goal"]:
            problems.append(f"{name}: date {row['date']!r}, goal {row['goal']!r}, machine {row['machine']!r}")
    assert not problems, "\n".join(problems)


def test_named_files_reads_the_commands_of_the_table():
    assert named_files("`python -m bench.chaos 50 --seed 10`") == ["bench/chaos.py"]
    assert named_files("bash bench/gpu_figures.sh --out /tmp/x") == ["bench/gpu_figures.sh"]
    assert named_files("python -m pytest -q -s tests/data/test_scrub_eval.py") == ["tests/data/test_scrub_eval.py"]
    assert named_files("make demo") == ["Makefile"]
    assert named_files("lifecycle sql 'SELECT 1'") == []
