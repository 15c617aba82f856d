"""collect: every input format, every bad-record reason, and the accounting identity."""

import gzip
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tasks.collect import CollectConfig, InputError, make_doc_id, resolve_inputs, run_collect


def write_jsonl(path, lines: list[bytes]):
    path.write_bytes(b"".join(l + b"\n" for l in lines))
    return path


def collect(tmp_path, patterns, **kw):
    return run_collect(CollectConfig(inputs=[str(tmp_path / p) for p in patterns], **kw), str(tmp_path / "w"))


def test_jsonl_good_and_bad_records_all_accounted(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", [
        json.dumps({"id": "doc-1", "text": "hello world", "url": "https://x.org", "lang": "en"}).encode(),
        b"this is not json",
        json.dumps({"id": "doc-3"}).encode(),
        json.dumps({"text": 42}).encode(),
        b'{"text": "broken \xff utf8"}',
        b"",  # blank lines are not records
        json.dumps({"text": "   "}).encode(),
        json.dumps(["a", "list"]).encode(),
        json.dumps({"text": "nul\u0000inside"}).encode(),
        json.dumps({"text": "last good one"}).encode(),
    ])
    ref = collect(tmp_path, ["a.jsonl"])
    kept = ref.read().to_pylist()
    assert [r["text"] for r in kept] == ["hello world", "last good one"]
    assert kept[0]["source_id"] == "doc-1" and kept[0]["url"] == "https://x.org"
    assert json.loads(kept[0]["meta"]) == {"lang": "en"}
    assert kept[1]["source_id"].endswith("a.jsonl:10")
    assert kept[0]["doc_id"] == make_doc_id("doc-1", "hello world")
    rej = {r["source_id"].rsplit("/", 1)[-1]: r["reason"] for r in ref.read_rejected().to_pylist()}
    assert rej == {"a.jsonl:2": "invalid_json", "doc-3": "missing_text", "a.jsonl:4": "text_not_string",
                   "a.jsonl:5": "invalid_utf8", "a.jsonl:7": "empty_text", "a.jsonl:8": "not_an_object",
                   "a.jsonl:9": "nul_bytes"}
    stats = ref.manifest()["stats"]
    assert stats["rows_in"] == 9 == stats["rows_kept"] + stats["rows_rejected"]
    assert all(r["detail"].startswith(str(tmp_path / "a.jsonl")) for r in ref.read_rejected().to_pylist())


def test_gzip_parquet_txt_and_truncated_gzip(tmp_path):
    with gzip.open(tmp_path / "b.jsonl.gz", "wb") as f:
        for i in range(200):
            f.write((json.dumps({"id": f"g{i}", "text": f"gzip record number {i} " * 20}) + "\n").encode())
    data = (tmp_path / "b.jsonl.gz").read_bytes()
    (tmp_path / "c.jsonl.gz").write_bytes(data[: len(data) // 2])  # truncated copy
    pq.write_table(pa.table({"text": ["parquet doc", None], "id": ["p1", "p2"], "extra": [1, 2]}), tmp_path / "d.parquet")
    (tmp_path / "e.txt").write_text("a whole text file is one document\nwith two lines")
    (tmp_path / "f.parquet").write_bytes(b"PAR1 this is not parquet")
    ref = collect(tmp_path, ["*.gz", "*.parquet", "*.txt"])
    rows = ref.read().to_pylist()
    ids = [r["source_id"] for r in rows]
    assert ids[:200] == [f"g{i}" for i in range(200)]
    truncated = [i for i in ids[200:] if i.startswith("g")]
    assert 0 < len(truncated) < 200  # what decompressed before the break is kept
    assert "p1" in ids and json.loads(rows[ids.index("p1")]["meta"]) == {"extra": 1}
    assert rows[-1]["text"].startswith("a whole text file") and rows[-1]["source_id"].endswith("e.txt")
    reasons = sorted(r["reason"] for r in ref.read_rejected().to_pylist())
    assert reasons == ["missing_text", "truncated_gzip", "unreadable_parquet"]
    s = ref.manifest()["stats"]
    assert s["rows_in"] == s["rows_kept"] + s["rows_rejected"]


def test_too_large_rule(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", [json.dumps({"text": "x" * 100}).encode(), json.dumps({"text": "ok"}).encode()])
    ref = collect(tmp_path, ["a.jsonl"], max_doc_bytes=50)
    assert [r["text"] for r in ref.read().to_pylist()] == ["ok"]
    assert [r["reason"] for r in ref.read_rejected().to_pylist()] == ["too_large"]


def test_manifest_contract_and_rerun_reuses(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", [json.dumps({"text": f"doc {i}"}).encode() for i in range(5)])
    ref = collect(tmp_path, ["a.jsonl"], rows_per_shard=2)
    m = ref.manifest()
    for key in ("stage", "fingerprint", "sha256", "num_rows", "files", "rejected", "parents", "config", "inputs"):
        assert key in m
    assert m["num_rows"] == 5 and len(m["files"]) == 3 and m["inputs"][0]["sha256"]
    assert not ref.reused
    again = collect(tmp_path, ["a.jsonl"], rows_per_shard=2)
    assert again.reused and again.sha256 == ref.sha256
    # changing an input file changes the fingerprint: a new dataset
    write_jsonl(tmp_path / "a.jsonl", [json.dumps({"text": "changed"}).encode()])
    changed = collect(tmp_path, ["a.jsonl"], rows_per_shard=2)
    assert not changed.reused and changed.fingerprint != ref.fingerprint


def test_bad_patterns_fail_before_work(tmp_path):
    with pytest.raises(InputError, match="matches no file"):
        resolve_inputs([str(tmp_path / "nothing-*.jsonl")])
    (tmp_path / "x.csv").write_text("a,b")
    with pytest.raises(InputError, match="unsupported input type"):
        resolve_inputs([str(tmp_path / "x.csv")])
