"""Every repository path and every `lifecycle.*` module a reader is pointed at exists (issue 42): in README.md and
docs/*.md (prose and code alike), in the module docstrings of the product's .py files, and in the field docs of the
config models (what `lifecycle config show` prints). tests/test_docs.py checks the docs' code spans and links; this
also reads the prose, the docstrings and the config docs, and the dotted module names.

A path is a word starting with one of the repository's folders and naming a file (`tasks/...py`, `docs/....md`) or a
folder with its slash (`flows/startup/`); a glob must match a file; words with placeholders (`<stage>`, `{name}`, `$VAR`, `...`) are skipped. A dotted name is
`lifecycle.<top>...` whose `<top>` is a module or package of the import name (MLflow tags such as
`lifecycle.promotion.decision` are not); its longest importable prefix must exist as a file, and up to two names
after it must be defined there (a function, a class and its method, a constant). Text only: nothing is imported.
"""

from __future__ import annotations

import ast
import re
import tomllib
from functools import cache
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.test_docs import WRITTEN_BY_THE_READER, prose

PACKAGE_DIR: dict[str, str] = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
PRODUCT = ("lifecycle", "flows", "lineage", "tasks")
FOLDERS = ("tasks", "flows", "lineage", "lifecycle", "bench", "deploy", "docs", "tests", "corpus")
PATH = re.compile(r"(?<![\w./<>~$@:-])(?:" + "|".join(FOLDERS) + r")/[^\s`'\"(),;\]|]*")
DOTTED = re.compile(r"(?<![\w./-])lifecycle(?:\.[A-Za-z_]\w*)+")
PLACEHOLDER = re.compile(r"[<>{}$]|\.\.\.")
# named on purpose although absent; each with the owner who fixes it or why it stays
ALLOWED = {
    "lifecycle.tasks.data.langfix",  # the worked example of docs/architecture.md, "How to add a stage"
    "docs/code-docs/source/memory.rst",  # tasks/train/zero_memory.py cites a file of DeepSpeed's repository
}


def sources() -> dict[str, str]:
    """Where each text comes from -> the text: the docs, the product's module docstrings, the config field docs."""
    out = {p.relative_to(ROOT).as_posix(): prose(p.read_text())
           for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]}
    for folder in PRODUCT:
        for f in sorted((ROOT / folder).rglob("*.py")):
            doc = ast.get_docstring(ast.parse(f.read_text()))
            if doc:
                out[f"{f.relative_to(ROOT).as_posix()} (docstring)"] = doc
    from lifecycle.config import config_fields

    out["lifecycle config show"] = "\n".join(f"{r['field']}: {r['doc']}" for r in config_fields())
    return out


SOURCES = sources()


def named_paths(text: str) -> set[str]:
    out = set()
    for word in PATH.findall(text):
        word = word.split("::")[0].split(":")[0].split("#")[0].removesuffix("**").rstrip(".")
        last = word.rstrip("/").rsplit("/", 1)[-1]
        # a file (a name with a suffix) or a folder written with its slash; not a rate such as `docs/s`
        if (re.search(r"\.\w", last) or word.endswith("/")) and not PLACEHOLDER.search(word):
            out.add(word)
    return out


def path_exists(word: str) -> bool:
    if "*" in word or "?" in word:
        return any(ROOT.glob(word))
    return (ROOT / word).exists() or word in WRITTEN_BY_THE_READER


def module_file(dotted: str) -> Path | None:
    """The file of module or package `dotted` under `package-dir` (longest mapped prefix), else None."""
    for package in sorted(PACKAGE_DIR, key=len, reverse=True):
        if dotted == package or dotted.startswith(package + "."):
            base = ROOT / PACKAGE_DIR[package] / Path(*dotted[len(package):].lstrip(".").split(".") or [""])
            for f in (base.with_suffix(".py"), base / "__init__.py"):
                if dotted[len(package):] and f.is_file() or f == base / "__init__.py" and base.is_dir():
                    return f if f.is_file() else base
    return None


@cache
def defined(file: Path) -> dict[str, set[str]]:
    """Top-level names of a module -> the names defined in their body (a class's methods and attributes)."""
    if file.is_dir():
        return {f.stem: set() for f in file.iterdir() if f.suffix == ".py" or f.is_dir()}
    out: dict[str, set[str]] = {}
    for node in ast.parse(file.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out[node.name] = {n.name for n in node.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))} | {
                t.id for n in node.body if isinstance(n, (ast.Assign, ast.AnnAssign))
                for t in (n.targets if isinstance(n, ast.Assign) else [n.target]) if isinstance(t, ast.Name)}
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if isinstance(t, ast.Name):
                    out[t.id] = set()
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            out.update({(a.asname or a.name).split(".")[0]: set() for a in node.names})
    return out


def tops() -> set[str]:
    """The names right under `lifecycle`: its modules and packages, and the folders mapped to `lifecycle.<x>`."""
    names = {f.stem for f in (ROOT / "lifecycle").iterdir() if f.suffix == ".py" or (f / "__init__.py").exists()}
    return names | {p.split(".")[1] for p in PACKAGE_DIR if p.count(".") == 1}


TOPS = tops()


def dotted_exists(name: str) -> bool:
    parts = name.split(".")
    for n in range(len(parts), 1, -1):
        f = module_file(".".join(parts[:n]))
        if f is None:
            continue
        rest = parts[n:]
        if not rest:
            return True
        names = defined(f)
        return len(rest) > 2 or rest[0] in names and (len(rest) == 1 or rest[1] in names[rest[0]] or not names[rest[0]])
    return False


def named_modules(text: str) -> set[str]:
    return {m for m in DOTTED.findall(text) if m.split(".")[1] in TOPS}


@pytest.mark.parametrize("where", sorted(SOURCES))
def test_every_named_path_and_module_exists(where):
    text = SOURCES[where]
    missing = sorted(p for p in named_paths(text) if not path_exists(p) and p not in ALLOWED)
    missing += sorted(m for m in named_modules(text) if not dotted_exists(m) and m not in ALLOWED)
    assert not missing, f"{where} names what is not in the repository (moved or renamed?): {missing}"


def test_the_scan_sees_paths_and_modules():
    """The patterns find what they are for, and a stale name fails."""
    text = ("see tasks/data/collect/extract.py, `deploy/configs/*.yaml`, docs/dedup.md. and tasks/data/<stage>/; "
            "lifecycle.tasks.data.dedup.minhash.signatures, lifecycle.core.shards.warm_worker and the tag "
            "lifecycle.promotion.decision; <workdir>/lifecycle/x and ~/.cache/lifecycle/")
    assert named_paths(text) == {"tasks/data/collect/extract.py", "deploy/configs/*.yaml", "docs/dedup.md"}
    assert all(path_exists(p) for p in named_paths(text))
    assert named_modules(text) == {"lifecycle.tasks.data.dedup.minhash.signatures", "lifecycle.core.shards.warm_worker"}
    assert all(dotted_exists(m) for m in named_modules(text))
    assert not path_exists("flows/runner.py") and not path_exists("tasks/extract.py")
    assert not dotted_exists("lifecycle.flows.runner") and not dotted_exists("lifecycle.core.shards.no_such_name")
    assert dotted_exists("lifecycle.flows.startup") and dotted_exists("lifecycle.lineage.tracking.Tracker.start")
    assert len(SOURCES) > 100 and "lifecycle config show" in SOURCES
