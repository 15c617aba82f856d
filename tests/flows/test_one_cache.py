"""The dataset store is the only cache, and it never serves output of code that has changed.

A stage's code version hashes its folder, the core and every project module they import (lifecycle.core.code);
its dataset's fingerprint chains on its parents' fingerprints. So editing one file in a stage's folder rebuilds
exactly that stage and the ones after it, and reuses every stage before it.

The edits are made to a COPY of the source tree: `lifecycle.core.code` is pointed at the copy (its `_folder`
re-rooted there), and the working tree is only read, so a test killed half-way leaves the checkout untouched.
The stages run in-process, shard by shard (`run_plan`), as the flow would run them minus Prefect.
"""

from __future__ import annotations

import json
import shutil
import tomllib
from pathlib import Path

import pytest

from lifecycle.config import load_config
from lifecycle.core import code
from lifecycle.core.shards import run_plan
from lifecycle.tasks.data.collect.stage import resolve_inputs
from lifecycle.tasks.stages import BY_NAME, DATA_STAGES, enabled, input_of
from tests.conftest import ROOT, corpus_records

PACKAGE_DIR: dict[str, str] = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]


@pytest.fixture
def source_copy(tmp_path, monkeypatch) -> Path:
    """A copy of the installed folders (lifecycle/ flows/ tasks/ lineage/); code versions are read from it."""
    copy = tmp_path / "src"
    for folder in PACKAGE_DIR.values():
        shutil.copytree(ROOT / folder, copy / folder, ignore=shutil.ignore_patterns("__pycache__"))
    real = code._folder

    def folder_in_copy(package: str) -> Path:
        return copy / real(package).relative_to(ROOT)

    monkeypatch.setattr(code, "_folder", folder_in_copy)
    return copy


def append_comment(copy: Path, relpath: str, n: int) -> None:
    f = copy / relpath
    assert f.is_file(), relpath
    f.write_text(f.read_text() + f"\n# edit {n}: a comment changes no behaviour, but it is new code\n")


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> list[str]:
    src = tmp_path_factory.mktemp("one-cache-in") / "docs.jsonl"
    recs = corpus_records(30)
    src.write_text("".join(json.dumps(r) + "\n" for r in recs + recs[:3]))  # 3 exact duplicates for dedup
    return [str(src)]


def run_data_stages(inputs: list[str], workdir: Path, overrides: tuple[str, ...] = ()) -> dict[str, tuple[str, bool]]:
    """collect..tokenize through the registry (optional stages when `overrides` turn them on): stage -> (dataset
    folder, reused)."""
    cfg = load_config(None, [f"workdir={workdir}", f"collect.inputs={json.dumps(inputs)}",
                             "tokenize.vocab_size=300", "tokenize.val_fraction=0.2", *overrides])
    out, refs = {}, {}
    for name in DATA_STAGES:
        stage = BY_NAME[name]
        if not enabled(stage, cfg):  # optional stages (decontaminate, quality, select) are off by default
            continue
        parent = input_of(name, refs)
        args = (*([refs[parent]] if parent else []), getattr(cfg, name), str(workdir))
        kw = {"inputs": resolve_inputs(cfg.collect.inputs)} if name == "collect" else {}
        ref = None
        if stage.plan:
            ref = run_plan(stage.entry("plan")(*args, **kw))
        if stage.run:
            sharded = {stage.sharded_arg: ref} if ref is not None else {}
            ref = stage.entry("run")(*args, **kw, **sharded)
        refs[name] = ref
        out[name] = (ref.path, ref.reused)
    return out


def test_the_copy_has_the_same_code_versions(source_copy, monkeypatch):
    """The redirection is faithful: an unedited copy gives the checkout's code versions, from the copy's files."""
    copied = {s: code.code_version(BY_NAME[s].package) for s in DATA_STAGES}
    assert all(str(f).startswith(str(source_copy)) for f in code.source_files(BY_NAME["scrub"].package).values())
    monkeypatch.undo()
    assert {s: code.code_version(BY_NAME[s].package) for s in DATA_STAGES} == copied


def test_an_edit_rebuilds_its_stage_and_the_ones_after_it_only(source_copy, inputs, tmp_path):
    wd = tmp_path / "w"
    first = run_data_stages(inputs, wd)
    assert not any(reused for _, reused in first.values()), first
    assert run_data_stages(inputs, wd) == {s: (p, True) for s, (p, _) in first.items()}  # nothing changed

    # a helper module of the filter stage (not its stage.py): the folder is the unit
    append_comment(source_copy, "tasks/data/filter/gopher_quality.py", 1)
    second = run_data_stages(inputs, wd)
    assert second["collect"] == (first["collect"][0], True)
    for s in ("filter", "dedup", "scrub", "tokenize"):
        assert second[s][1] is False and second[s][0] != first[s][0], (s, second[s], first[s])

    # an edit to a later stage (scrub's detectors) reuses everything before it
    append_comment(source_copy, "tasks/data/scrub/detectors.py", 2)
    third = run_data_stages(inputs, wd)
    for s in ("collect", "filter", "dedup"):
        assert third[s] == (second[s][0], True), s
    for s in ("scrub", "tokenize"):
        assert third[s][1] is False and third[s][0] not in (first[s][0], second[s][0]), s

    # the last stage: only it, and image_preprocess, which imports it (to train its caption tokenizer)
    append_comment(source_copy, "tasks/data/tokenize/stage.py", 3)
    fourth = run_data_stages(inputs, wd)
    rebuilt = ("tokenize", "image_preprocess")
    assert {s: v for s, v in fourth.items() if s not in rebuilt} == {s: (p, True) for s, (p, _) in third.items()
                                                                     if s not in rebuilt}
    for s in rebuilt:
        assert fourth[s][1] is False and fourth[s][0] != third[s][0], s

    # the core is part of every stage's code: everything is rebuilt
    append_comment(source_copy, "lifecycle/core/fs.py", 4)
    fifth = run_data_stages(inputs, wd)
    assert all(not reused and path != fourth[s][0] for s, (path, reused) in fifth.items()), fifth

    # the rows never changed (comments only): every rebuild made the same content
    sha = {s: json.loads((Path(p) / "_manifest.json").read_text())["sha256"] for s, (p, _) in first.items()}
    assert {s: json.loads((Path(p) / "_manifest.json").read_text())["sha256"] for s, (p, _) in fifth.items()} == sha


def test_an_edit_outside_the_stages_imports_changes_no_data_stage(source_copy):
    """Flows, lineage and the train/eval stages are not imported by a data stage: editing them keeps its version."""
    before = {s: code.code_version(BY_NAME[s].package) for s in DATA_STAGES}
    for n, f in enumerate(["flows/stage_runner.py", "lineage/tracking.py", "tasks/train/launch.py",
                           "tasks/eval/evaluate/stage.py", "lifecycle/config.py"]):
        append_comment(source_copy, f, n)
    assert {s: code.code_version(BY_NAME[s].package) for s in DATA_STAGES} == before
    train = code.code_version(BY_NAME["train"].package)
    append_comment(source_copy, "tasks/data/tokenize/stage.py", 9)  # train imports tokenize's reader
    assert code.code_version(BY_NAME["train"].package) != train
