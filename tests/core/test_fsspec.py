"""Inputs by fsspec URL (file://, and memory:// as a stand-in for an object store); a file:// work dir."""

from __future__ import annotations

import gzip
import json

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lifecycle.config import ConfigError, load_config
from lifecycle.tasks.data.collect.stage import CollectConfig, resolve_inputs, run_collect
from tests.conftest import corpus_records, last_json, lifecycle

HTML = b"<html><body><article><h1>Reading room</h1><p>" + b"The reading room opens at nine every morning. " * 20 + \
       b"</p></article></body></html>"


@pytest.fixture
def inputs(tmp_path):
    d = tmp_path / "in"
    d.mkdir()
    recs = corpus_records(30)
    with gzip.open(d / "a.jsonl.gz", "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in recs[:20])
        f.write("{broken\n")
    pq.write_table(pa.table({"id": [r["id"] for r in recs[20:]], "text": [r["text"] for r in recs[20:]]}),
                   d / "b.parquet")
    (d / "c.html").write_bytes(HTML)
    return d


def outcome(ref):
    rej = ref.read_rejected().to_pylist()
    return sorted(ref.read(["text"]).column("text").to_pylist()), sorted(r["reason"] for r in rej)


def test_file_and_memory_urls_collect_the_same_documents_as_paths(inputs, tmp_path):
    local = run_collect(CollectConfig(inputs=[str(inputs / "*")]), str(tmp_path / "w1"))
    url = run_collect(CollectConfig(inputs=[f"file://{inputs}/*"]), str(tmp_path / "w2"))
    mem = fsspec.filesystem("memory")
    for p in inputs.iterdir():
        mem.pipe(f"/lc-test/{p.name}", p.read_bytes())
    try:
        raws = resolve_inputs(["memory://lc-test/*"])
        assert [r.path for r in raws] == [f"memory:///lc-test/{n}" for n in ("a.jsonl.gz", "b.parquet", "c.html")]
        assert [r.sha256 for r in raws] == [r.sha256 for r in resolve_inputs([str(inputs / "*")])]
        remote = run_collect(CollectConfig(inputs=["memory://lc-test/*"]), str(tmp_path / "w3"))
    finally:
        mem.rm("/lc-test", recursive=True)
    texts, reasons = outcome(local)
    assert len(texts) == 31 and reasons == ["invalid_json"]  # 20 JSONL + 10 Parquet + 1 HTML page
    assert outcome(url) == outcome(remote) == (texts, reasons)
    assert [i["path"] for i in url.manifest()["inputs"]][0].startswith("file://")  # lineage keeps the URL
    rejected = url.read_rejected().to_pylist()[0]
    assert rejected["source_id"].startswith(f"file://{inputs}/a.jsonl.gz:") and "a.jsonl.gz" in rejected["detail"]


def test_url_pattern_matching_nothing_is_an_input_error(tmp_path):
    from lifecycle.tasks.data.collect.stage import InputError

    with pytest.raises(InputError, match="matches no file"):
        resolve_inputs([f"file://{tmp_path}/nothing-*.jsonl"])


def test_object_store_work_dir_is_refused_with_the_reason(tmp_path):
    cfg = load_config(None, [f"workdir=file://{tmp_path}/w", f"collect.inputs=[\"{tmp_path}/x\"]"])
    assert cfg.workdir == str(tmp_path / "w")
    with pytest.raises(ConfigError, match="atomic rename, fsync and flock"):
        load_config(None, ["workdir=s3://bucket/runs", f"collect.inputs=[\"{tmp_path}/x\"]"])


def test_run_with_file_urls_for_work_dir_and_inputs(inputs, tmp_path):
    wd = tmp_path / "w"
    out = last_json(lifecycle("run", "--json", "--until", "filter", "--set", f"workdir=file://{wd}",
                              "--set", f"collect.inputs=[\"file://{inputs}/*\"]", "--set", "collect.shard_bytes=1").stdout)
    assert out["workdir"] == str(wd) and out["stages"] == {"collect": "computed", "filter": "computed"}
    collect = json.loads(open(out["datasets"]["collect"]).read())
    assert collect["shards"] == 3 and collect["stats"]["rows_in"] == 32  # 3 files, each its own shard (Dask)
    assert all(i["path"].startswith(f"file://{inputs}/") for i in collect["inputs"])


def test_declared_input_roots_apply_to_file_urls(tmp_path):
    ok = load_config(None, [f"input_roots=[\"{tmp_path}\"]", f"collect.inputs=[\"file://{tmp_path}/in/*.jsonl\"]"])
    assert ok.collect.inputs == [f"file://{tmp_path}/in/*.jsonl"]
    with pytest.raises(ConfigError, match="not inside `input_roots`"):
        load_config(None, [f"input_roots=[\"{tmp_path}\"]", "collect.inputs=[\"file:///etc/*.conf\"]"])
