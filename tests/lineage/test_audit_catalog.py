"""Audit commands answer without heavy imports, from a catalog built once and updated with what changed.

`import lifecycle.cli`, and `lifecycle sql` / `lineage doc` / `lineage model` up to their answer, import none of
torch, mlflow, prefect, deepspeed or pandas (checked in a fresh interpreter's sys.modules: deterministic, not timed;
the times are in bench/audit_latency.py). The catalog (`<workdir>/catalog/`) reads each manifest once, and
reads the MLflow registry again only when its digest changed."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pyarrow as pa
import pytest

from lifecycle.lineage import catalog
from tests.conftest import ROOT, make_collect

HEAVY = ("torch", "mlflow", "prefect", "deepspeed", "pandas")

# run one `lifecycle` command in a fresh interpreter and report what it imported
PROBE = textwrap.dedent("""
    import contextlib, io, json, sys
    from lifecycle.cli import main
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(sys.argv[1:])
    heavy = sorted(m for m in sys.modules if m.split(".")[0] in %r)
    print(json.dumps({"rc": rc, "out": out.getvalue(), "heavy": sorted({m.split(".")[0] for m in heavy})}))
""" % (HEAVY,))


def probe(*argv: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", PROBE, *map(str, argv)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def docs(prefix: str, n: int = 2) -> pa.Table:
    return pa.table({"doc_id": [f"{prefix}{i}" for i in range(n)], "source_id": [f"src-{prefix}{i}" for i in range(n)],
                     "text": ["a document"] * n, "source": ["x"] * n, "url": [None] * n, "meta": [None] * n})


@pytest.fixture(scope="module")
def empty_store(tmp_path_factory):
    """An empty MLflow SQLite store with its tables created (MLflow's migrations take seconds: done once)."""
    from mlflow import MlflowClient

    db = tmp_path_factory.mktemp("store") / "mlflow.db"
    MlflowClient(tracking_uri=f"sqlite:///{db}", registry_uri=f"sqlite:///{db}").search_registered_models()
    return db


def model_package(wd, ref):
    """A model package directory in the work dir whose lineage.json names the dataset `ref`."""
    pkg = wd / "datasets" / "checkpoint" / "pkg"
    pkg.mkdir(parents=True)
    (pkg / "lineage.json").write_text(json.dumps({
        "datasets": [{"stage": ref.stage, "sha256": ref.sha256, "num_rows": ref.num_rows,
                      "manifest": str(ref.manifest_path)}],
        "checkpoint_dir": str(wd / "train"), "checkpoint_marker_sha256": "0" * 64, "tokenizer_sha256": "1" * 64}))
    return pkg


@pytest.fixture
def workdir(tmp_path, empty_store):
    """A work dir with a committed dataset and a real MLflow registry holding one version of a model whose
    package (lineage.json) lies in the work dir."""
    import shutil

    from mlflow import MlflowClient

    wd = tmp_path / "w"
    ref = make_collect(str(wd), [docs("d")], fixture="audit")
    pkg = model_package(wd, ref)
    shutil.copy(empty_store, wd / "mlflow.db")
    uri = f"sqlite:///{wd}/mlflow.db"
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    client.create_registered_model("m")
    client.create_model_version("m", source=str(pkg), tags={
        "lifecycle.model_package_manifest": str(pkg / "_manifest.json"), "lifecycle.config_sha256": "2" * 64})
    return wd, ref, client


def test_importing_the_cli_loads_no_heavy_module():
    code = f"import sys, json, lifecycle.cli; print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r})))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert json.loads(out) == []


def test_audit_commands_answer_without_heavy_imports(workdir):
    wd, ref, _ = workdir
    first = probe("sql", "SELECT count(*) AS n FROM kept", "--workdir", wd, "--json")  # builds the catalog
    assert first["rc"] == 0 and json.loads(first["out"]) == [{"n": 2}]
    assert (wd / catalog.CATALOG / "index.json").is_file()
    for argv in (["sql", "SELECT name, version FROM models", "--workdir", wd, "--json"],
                 ["lineage", "doc", "src-d1", "--workdir", wd, "--json"],
                 ["lineage", "model", "m", "--workdir", wd, "--json"],
                 ["sql", "SELECT stage, num_rows FROM datasets", "--workdir", wd]):  # the table printer too
        got = probe(*argv)
        assert got["rc"] == 0 and got["heavy"] == [], (argv, got)
        assert got["out"].strip(), argv
    answer = json.loads(probe("lineage", "model", "m/1", "--workdir", wd, "--json")["out"])
    assert answer["model"]["version"] == "1" and answer["datasets"][0]["sha256"] == ref.sha256
    doc = json.loads(probe("lineage", "doc", "src-d1", "--workdir", wd, "--json")["out"])
    assert doc["doc_ids"] == ["d1"] and doc["events"][0]["dataset_sha256"] == ref.sha256


def test_the_catalog_reads_each_manifest_once_and_picks_up_new_commits(workdir, monkeypatch):
    wd, ref, _ = workdir
    read = []
    entry = catalog._dataset_entry
    monkeypatch.setattr(catalog, "_dataset_entry", lambda w, mp, m: read.append(mp) or entry(w, mp, m))
    catalog.update(wd)
    assert read == [ref.manifest_path.resolve()]
    read.clear()
    con = catalog.connect(wd)
    assert read == [] and catalog.query(con, "SELECT count(*) AS n FROM kept") == [{"n": 2}]
    new = make_collect(str(wd), [docs("e", 3)], fixture="audit-2")  # a commit the flow did not tell the catalog
    con = catalog.connect(wd)
    assert read == [new.manifest_path.resolve()]
    assert catalog.query(con, "SELECT count(*) AS n FROM kept") == [{"n": 5}]
    assert sorted(r["sha256"] for r in catalog.query(con, "SELECT sha256 FROM datasets")) == sorted([ref.sha256, new.sha256])


def test_the_registry_is_read_again_only_when_it_changed(workdir, monkeypatch):
    wd, _, client = workdir
    calls = []
    rows = catalog.model_rows
    monkeypatch.setattr(catalog, "model_rows", lambda uri: calls.append(uri) or rows(uri))
    assert [m["version"] for m in catalog.update(wd)["models"]["rows"]] == [1]
    assert len(calls) == 1
    catalog.update(wd)
    assert len(calls) == 1  # unchanged registry: the saved rows
    client.set_registered_model_alias("m", "champion", "1")
    con = catalog.connect(wd)
    assert len(calls) == 2
    assert catalog.query(con, "SELECT version, aliases FROM models") == [{"version": 1, "aliases": "champion"}]


def test_a_damaged_or_edited_catalog_index_is_rebuilt_and_its_paths_rechecked(workdir, tmp_path):
    wd, ref, _ = workdir
    catalog.update(wd)
    index = wd / catalog.CATALOG / "index.json"
    state = json.loads(index.read_text())
    # an edited catalog index naming a file outside the work dir is refused like a manifest naming one
    entry = next(iter(state["datasets"].values()))
    entry["files"]["kept"].append("/etc/passwd")
    index.write_text(json.dumps(state))
    with pytest.raises(Exception, match="not inside the work dir"):
        catalog.connect(wd)
    index.write_text("{not json")
    con = catalog.connect(wd)
    assert catalog.query(con, "SELECT count(*) AS n FROM kept") == [{"n": 2}]


def test_a_read_only_work_dir_is_answered_from_a_temporary_catalog(workdir):
    import os

    wd, _, _ = workdir
    os.chmod(wd, 0o555)
    try:
        if os.access(wd, os.W_OK):  # root ignores the mode: make the catalog folder unwritable another way
            (wd / catalog.CATALOG).write_text("a file where the catalog folder goes")
        con = catalog.connect(wd)
        assert catalog.query(con, "SELECT count(*) AS n FROM kept") == [{"n": 2}]
        assert catalog.query(con, "SELECT name FROM models") == [{"name": "m"}]
    finally:
        os.chmod(wd, 0o755)


def test_model_docs_counts_only_the_tokenize_dataset_a_version_trained_on(tmp_path, empty_store):
    """Issue 41 §3: a failed run's committed tokenize dataset held the same documents again, and "which documents
    trained this model" over models, datasets and tokens counted 2,810 for a model trained on 1,405."""
    import shutil

    from mlflow import MlflowClient

    from lifecycle.core.dataset import StageStats, materialize

    wd = tmp_path / "w"
    side = pa.table({"doc_id": ["d0", "d1", "d2"], "source_id": ["s0", "s1", "s2"], "split": ["train", "train", "val"],
                     "shard": ["train-00000.bin"] * 2 + ["val-00000.bin"], "token_start": [0, 5, 0],
                     "token_end": [5, 9, 4]})

    def tokenize(fixture):
        def build(writer):
            writer.write_table(side)
            return {"stats": StageStats(rows_in=3, rows_kept=3)}
        return materialize(str(wd), "tokenize", {"fixture": fixture}, "test", build)

    tokenize("failed-run")  # committed, then the run failed before training
    used = tokenize("the-run")
    pkg = model_package(wd, used)
    shutil.copy(empty_store, wd / "mlflow.db")
    client = MlflowClient(tracking_uri=f"sqlite:///{wd}/mlflow.db", registry_uri=f"sqlite:///{wd}/mlflow.db")
    client.create_registered_model("m")
    client.create_model_version("m", source=str(pkg), tags={
        "lifecycle.model_package_manifest": str(pkg / "_manifest.json"),
        "lifecycle.dataset.tokenize.sha256": used.sha256})
    con = catalog.connect(wd)
    assert catalog.query(con, "SELECT count(*) AS n FROM tokens WHERE split = 'train'") == [{"n": 4}]  # both datasets
    assert catalog.query(con, "SELECT count(DISTINCT doc_id) AS n FROM model_docs WHERE name = 'm' AND version = 1 "
                              "AND split = 'train'") == [{"n": 2}]
