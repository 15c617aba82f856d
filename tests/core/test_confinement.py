"""Path confinement (issue 6): config paths and CLI arguments are resolved (symlinks followed) and must lie in the
work dir or a declared input root; the audit commands read nothing outside the work dir, and `lifecycle sql`
cannot reach any file but the catalog's own through DuckDB."""

import json
import os
from pathlib import Path

import pyarrow as pa
import pytest

from lifecycle.config import ConfigError, load_config
from lifecycle.core.dataset import MANIFEST
from lifecycle.lineage import catalog
from lifecycle.tasks.data.collect.stage import InputError, resolve_inputs
from tests.conftest import ROOT, last_json, lifecycle, make_collect
from tests.conftest import lifecycle_in_process as cli

DEMO = ROOT / "deploy/configs/demo.yaml"
OUTSIDE = "allowed roots"  # every confinement error says which roots were allowed


def doc(path: Path, text: str = "a document") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"id": path.stem, "text": text}) + "\n")
    return path


# ---------------------------------------------------------------------------------------------- config


@pytest.mark.parametrize("override, field", [
    ('collect.inputs=["../../etc/passwd"]', "collect.inputs[0]"),
    ('collect.inputs=["/etc/*.conf"]', "collect.inputs[0]"),
    ('collect.inputs=["{inside}/*.jsonl", "{outside}/*.jsonl"]', "collect.inputs[1]"),
    ("tokenize.tokenizer_file={outside}/tokenizer.json", "tokenize.tokenizer_file"),
])
def test_declared_input_roots_refuse_paths_outside(tmp_path, override, field):
    inside, outside = tmp_path / "data", tmp_path / "elsewhere"
    doc(inside / "a.jsonl"), doc(outside / "b.jsonl")
    with pytest.raises(ConfigError) as e:
        load_config(DEMO, [f'input_roots=["{inside}"]', f"workdir={tmp_path / 'w'}",
                           f'collect.inputs=["{inside}/*.jsonl"]', override.format(inside=inside, outside=outside)])
    msg = str(e.value)
    assert f"`{field}`" in msg and OUTSIDE in msg and str(inside) in msg and str(tmp_path / "w") in msg


def test_declared_input_roots_accept_inputs_inside_them_and_the_workdir(tmp_path):
    inside = tmp_path / "data"
    doc(inside / "a.jsonl"), doc(tmp_path / "w" / "in" / "b.jsonl")
    cfg = load_config(DEMO, [f'input_roots=["{inside}"]', f"workdir={tmp_path / 'w'}",
                             f'collect.inputs=["{inside}/**/*.jsonl", "{tmp_path}/w/in/*.jsonl", "s3://bucket/x/*.jsonl"]',
                             f"tokenize.tokenizer_file={inside}/tok.json"])
    assert cfg.input_roots == [str(inside)]


def test_a_symlinked_directory_cannot_smuggle_a_root(tmp_path):
    """data/link -> elsewhere: the pattern's directory resolves outside the declared root."""
    inside, outside = tmp_path / "data", tmp_path / "elsewhere"
    doc(outside / "b.jsonl")
    inside.mkdir()
    (inside / "link").symlink_to(outside, target_is_directory=True)
    with pytest.raises(ConfigError, match=f"resolves to {outside}, which is outside the {OUTSIDE}"):
        load_config(DEMO, [f'input_roots=["{inside}"]', f'collect.inputs=["{inside}/link/*.jsonl"]'])


def test_lifecycle_run_refuses_an_escaping_input_before_any_work(tmp_path):
    wd = tmp_path / "w"
    proc = lifecycle("run", DEMO, "--json", "--set", f"workdir={wd}", "--set", f'input_roots=["{tmp_path}"]',
                     "--set", 'collect.inputs=["/etc/passwd"]', rc=2)
    out = last_json(proc.stdout)
    assert out["status"] == "invalid_config" and "/etc/passwd" in out["error"] and OUTSIDE in out["error"]
    assert not wd.exists()


# ---------------------------------------------------------------------------------------------- collect


def test_a_symlink_out_of_the_pattern_directory_is_refused(tmp_path):
    """Even without declared roots: a matched file must resolve inside the pattern's own directory."""
    secret = doc(tmp_path / "private" / "secret.jsonl")
    data = tmp_path / "data"
    doc(data / "a.jsonl")
    (data / "b.jsonl").symlink_to(secret)
    with pytest.raises(InputError) as e:
        resolve_inputs([f"{data}/*.jsonl"])
    assert f"{data}/b.jsonl resolves to {secret}" in str(e.value) and str(data) in str(e.value)
    (data / "b.jsonl").unlink()
    assert [r.path for r in resolve_inputs([f"{data}/*.jsonl"])] == [str(data / "a.jsonl")]


def test_dot_dot_after_a_glob_is_refused(tmp_path):
    doc(tmp_path / "data" / "sub" / "a.jsonl"), doc(tmp_path / "other.jsonl")
    with pytest.raises(InputError, match=OUTSIDE):
        resolve_inputs([f"{tmp_path}/data/*/../../other.jsonl"])


# ---------------------------------------------------------------------------------------------- audit commands


@pytest.fixture
def workdir(tmp_path):
    wd = tmp_path / "w"
    t = pa.table({"doc_id": ["d1", "d2"], "source_id": ["s1", "s2"], "text": ["one", "two"],
                  "source": ["x", "x"], "url": [None, None], "meta": [None, None]})
    ref = make_collect(str(wd), [t], fixture="confinement")
    return wd, ref


def test_sql_queries_the_catalog_but_cannot_read_other_files(workdir, capsys, tmp_path):
    wd, _ = workdir
    rc, rows = cli(capsys, "sql", "SELECT source_id FROM kept ORDER BY 1", "--workdir", str(wd))
    assert rc == 0 and rows == [{"source_id": "s1"}, {"source_id": "s2"}]
    rc, rows = cli(capsys, "sql", "DESCRIBE datasets", "--workdir", str(wd))
    assert rc == 0 and {"column_name": "stage"} .items() <= rows[0].items()
    (wd / "link.csv").symlink_to("/etc/passwd")
    for query in ["SELECT * FROM read_csv('/etc/passwd')", "SELECT * FROM read_text('/etc/passwd')",
                  f"SELECT * FROM read_text('{wd}/link.csv')", "SELECT * FROM glob('/etc/*')",
                  f"SELECT * FROM read_parquet('{wd}/datasets/*/*/*.parquet')"]:
        rc, err = cli(capsys, "sql", query, "--workdir", str(wd))
        assert rc == 2 and "Permission Error" in err["error"], (query, err)
    for query in ["ATTACH '/tmp/x.db'", f"COPY (SELECT 1) TO '{wd}/out.csv'", "SET enable_external_access = true",
                  "INSTALL httpfs", "SELECT 1; COPY kept TO '/tmp/kept.csv'"]:
        rc, err = cli(capsys, "sql", query, "--workdir", str(wd))
        assert rc == 2 and "only SELECT" in err["error"], (query, err)
    assert not (wd / "out.csv").exists()


def test_the_catalog_connection_itself_is_locked(workdir):
    """Not only the statement filter: DuckDB refuses other files and refuses to be unlocked."""
    import duckdb

    wd, ref = workdir
    con = catalog.connect(wd)
    assert catalog.query(con, "SELECT count(*) AS n FROM kept") == [{"n": 2}]
    with pytest.raises(duckdb.PermissionException):
        con.execute("SELECT * FROM read_text('/etc/passwd')")
    with pytest.raises(duckdb.PermissionException):
        con.execute(f"COPY (SELECT 1) TO '{wd}/out.csv'")
    with pytest.raises(duckdb.InvalidInputException, match="locked"):
        con.execute("SET enable_external_access = true")


def test_a_manifest_naming_a_file_outside_is_refused(workdir, capsys):
    wd, ref = workdir
    m = json.loads(ref.manifest_path.read_text())
    m["rejected"] = [{"path": "../../../../../../../../etc/passwd"}]
    ref.manifest_path.write_text(json.dumps(m))
    rc, err = cli(capsys, "lineage", "doc", "s1", "--workdir", str(wd))
    assert rc == 2 and "/etc/passwd" in err["error"] and "not inside the work dir" in err["error"]


def test_a_symlinked_dataset_out_of_the_workdir_is_refused(workdir, tmp_path, capsys):
    wd, ref = workdir
    elsewhere = tmp_path / "elsewhere"
    os.rename(ref.dir, elsewhere)
    ref.dir.symlink_to(elsewhere, target_is_directory=True)
    rc, err = cli(capsys, "sql", "SELECT count(*) FROM kept", "--workdir", str(wd))
    assert rc == 2 and str(elsewhere) in err["error"] and OUTSIDE in err["error"]


def test_tracking_uri_must_name_a_store_in_the_workdir(workdir, capsys):
    wd, _ = workdir
    for uri in ["sqlite:////etc/passwd", "file:///etc", "/etc/passwd"]:
        rc, err = cli(capsys, "lineage", "doc", "s1", "--workdir", str(wd), "--tracking-uri", uri)
        assert rc == 2 and "--tracking-uri" in err["error"] and OUTSIDE in err["error"], uri
        rc, err = cli(capsys, "lineage", "model", "m", "--workdir", str(wd), "--tracking-uri", uri)
        assert rc == 2 and OUTSIDE in err["error"], uri


def test_forget_does_not_write_through_a_symlinked_audit_dir(workdir, tmp_path, capsys):
    wd, _ = workdir
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (wd / "audit").symlink_to(elsewhere, target_is_directory=True)
    rc, err = cli(capsys, "lineage", "forget", "s1", "--workdir", str(wd))
    assert rc == 2 and OUTSIDE in err["error"] and list(elsewhere.iterdir()) == []
    (wd / "audit").unlink()
    rc, rep = cli(capsys, "lineage", "forget", "s1", "--workdir", str(wd))
    assert rc == 0 and Path(rep["report"]).parent == wd / "audit"


def test_lineage_model_does_not_follow_a_registry_tag_out_of_the_workdir(workdir, tmp_path, capsys):
    """A real MLflow registry whose version tag names a package outside the work dir."""
    from mlflow import MlflowClient

    wd, _ = workdir
    pkg = tmp_path / "elsewhere" / "pkg"
    pkg.mkdir(parents=True)
    (pkg / "lineage.json").write_text(json.dumps({"datasets": [], "checkpoint_dir": "x"}))
    uri = f"sqlite:///{wd}/mlflow.db"
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    client.create_registered_model("m")
    client.create_model_version("m", source=str(pkg), tags={"lifecycle.model_package_manifest": str(pkg / MANIFEST)})
    rc, err = cli(capsys, "lineage", "model", "m", "--workdir", str(wd))
    assert rc == 2 and str(pkg / "lineage.json") in err["error"] and "not inside the work dir" in err["error"]


# ---------------------------------------------------------------------------------------------- export


@pytest.mark.parametrize("which", ["checkpoint", "tokenizer", "symlinked checkpoint"])  # OUT_DIR: anywhere (issue 24)
def test_export_hf_arguments_are_confined(tmp_path, capsys, which):
    wd, outside = tmp_path / "w", tmp_path / "elsewhere"
    (wd / "ckpt").mkdir(parents=True), outside.mkdir()
    (wd / "link").symlink_to(outside, target_is_directory=True)
    args = {"checkpoint": str(wd / "ckpt"), "out_dir": str(wd / "hf"), "tokenizer": str(wd / "tok.json")}
    key = which.split()[-1]
    args[key] = str(wd / "link") if which.startswith("symlinked") else str(outside / "x")
    rc, err = cli(capsys, "export", "hf", args["checkpoint"], args["out_dir"], "--tokenizer", args["tokenizer"],
                  "--workdir", str(wd))
    assert rc == 2 and OUTSIDE in err["error"] and str(outside) in err["error"]
    assert not (wd / "hf").exists() and list(outside.iterdir()) == []
