"""A document looked up by an id that no dataset holds gets a near match (issue 41 §4): `lineage doc` with the file
name of a source_id that is a path, and `lifecycle forget` with an unknown id, which refuses in one line, exit 2,
records nothing and names the work dir it looked in (issue 44, item 1)."""

from __future__ import annotations

import duckdb
import pytest

from lifecycle.core.errors import UsageError
from lifecycle.core.suggest import near_ids
from lifecycle.tasks.data.collect.tombstones import find_documents
from tests.conftest import docs_table, make_collect
from tests.test_cli_errors import assert_one_line, run_cli


def ids_table():
    con = duckdb.connect()
    con.execute("CREATE TABLE t AS SELECT * FROM (VALUES ('a1b2c3d4e5f60718', '/usr/share/doc/pg/html/functions-datetime.html'), "
                "('ffff000011112222', '/usr/share/doc/pg/html/functions-math.html'), "
                "('0123456789abcdef', 'good1-3')) v(doc_id, source_id)")
    return con


def test_near_ids_finds_a_file_name_inside_a_path_and_a_one_character_typo():
    con = ids_table()
    assert near_ids(con, "t", "functions-datetime.html") == ["/usr/share/doc/pg/html/functions-datetime.html"]
    assert near_ids(con, "t", "a1b2c3d4e5f60719") == ["a1b2c3d4e5f60718"]  # last character mistyped
    assert near_ids(con, "t", "zzzzzzzz") == []


@pytest.fixture
def workdir(tmp_path):
    wd = tmp_path / "wd"
    make_collect(wd, [docs_table(["The first document of a small work dir.", "A second one."])])
    return wd


def test_an_unknown_id_is_refused_with_a_near_match(workdir):
    assert [d["doc_id"] for d in find_documents(workdir, ["src-d1"])] == ["d1"]
    with pytest.raises(UsageError, match=r"holds a document with doc_id or source_id src-d7: nothing was recorded; "
                                         r"did you mean src-d0, src-d1\?"):
        find_documents(workdir, ["src-d7"])


def test_lifecycle_forget_names_the_work_dir_from_the_environment_and_refuses_unknown_ids(
        capsys, workdir, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # no deploy/configs/demo.yaml here: the built-in defaults, with the work dir
    monkeypatch.setenv("LIFECYCLE_WORKDIR", str(workdir))
    rc, out, err = run_cli(capsys, ["forget", "no-such-id", "--reason", "erasure request 1"])
    line = assert_one_line(rc, err, str(workdir), "no-such-id", "nothing was recorded")
    assert "internal error" not in line
    assert f"forget: work dir {workdir} (from $LIFECYCLE_WORKDIR)" in out
    assert not (workdir / "tombstones.parquet").exists()


def test_lineage_doc_offers_the_near_ids(capsys, workdir):
    rc, out, err = run_cli(capsys, ["lineage", "doc", "src-d7", "--workdir", workdir])
    assert rc == 3 and "no document with doc_id or source_id 'src-d7' in any dataset; did you mean src-d0, src-d1?" in out


def test_lineage_forget_prints_its_answer_before_any_file_list(capsys, tmp_path):
    from lifecycle.lineage.cli import print_forget

    raw = [{"path": f"/data/doc{i}.rst", "sha256": f"{i:064x}", "bytes": 10} for i in range(3000)]
    r = {"requested_source_ids": ["a"], "doc_ids": ["d1"], "not_found": [], "raw_input_files": raw,
         "raw_positions": [{"doc_id": "d1", "raw_path": "/data/doc7.rst", "record": 0, "byte_start": None}],
         "datasets": [{"stage": "collect", "sha256": "c" * 64, "documents": 1, "held_as": "kept", "path": "p"}],
         "token_ranges": [], "clusters": [], "checkpoints": [], "model_packages": [], "model_versions": [],
         "tombstones": []}
    print_forget(r, tmp_path / "report.json")
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 5 and "held by 1 dataset(s), 0 checkpoint(s), 0 model version(s)" in out[0]
    assert out[1] == "  raw input   3,000 raw file(s), 30,000 bytes (--files lists them)"
    assert out[2].startswith("  raw record  d1  /data/doc7.rst  record 0")
    print_forget(r, tmp_path / "report.json", files=True)
    assert len(capsys.readouterr().out.splitlines()) == 3000 + 4


def test_an_unlearning_covers_every_tombstone_its_champion_is_tainted_by():
    """Issue 44, 1b: `forget A --unlearn` was stopped after its tombstone; `forget B --unlearn` then unlearned only B
    from the champion tainted by A and B, and moved @champion to a version still trained on A."""
    from lifecycle.lineage.forgetting import covering_tombstones

    a = {"tombstone_id": "tA", "doc_id": "dA"}
    b = {"tombstone_id": "tB", "doc_id": "dB"}
    assert covering_tombstones([b], ("1", "tA,tB"), [a, b]) == [b, a]  # A's pending tombstone joins B's
    assert covering_tombstones([b], None, [a, b]) == [b]  # an untainted champion: only what was asked
    with pytest.raises(UsageError, match="tainted by tombstone.*tC.*refusing to unlearn only part"):
        covering_tombstones([b], ("1", "tB,tC"), [a, b])
