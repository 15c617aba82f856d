"""Collect from `s3://` against a real S3-compatible server: moto's server (the `s3` extra's test dependency),
started by this module in its own process on the loopback. Credentials and the endpoint come from the environment
(AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL), as for any S3 client; the rows must be those that
the same files give from local paths."""

from __future__ import annotations

import gzip
import json
import os
import socket
import subprocess
import sys
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lifecycle.core.procs import free_port
from lifecycle.tasks.data.collect.stage import CollectConfig, resolve_inputs, run_collect
from tests.conftest import corpus_records, last_json, lifecycle

BUCKET, PREFIX = "lc-bucket", "raw/2026"
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "lifecycle-test", "AWS_SECRET_ACCESS_KEY": "lifecycle-test-secret",
               "AWS_DEFAULT_REGION": "us-east-1"}


@pytest.fixture(scope="module")
def s3_server():
    """moto's S3 server in its own process on 127.0.0.1; its URL."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert proc.poll() is None and time.time() < deadline, "moto server did not start"
                time.sleep(0.2)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture
def inputs(tmp_path):
    """Local input files: JSONL (one bad line), gzipped JSONL, Parquet, and a file the pattern must not match."""
    d = tmp_path / "in"
    d.mkdir()
    recs = corpus_records(24)
    (d / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs[:10]) + "{broken\n")
    with gzip.open(d / "b.jsonl.gz", "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in recs[10:18])
    pq.write_table(pa.table({"id": [r["id"] for r in recs[18:]], "text": [r["text"] for r in recs[18:]]}),
                   d / "c.parquet")
    (d / "notes.txt").write_text("not an input of this pattern\n")
    return d


@pytest.fixture
def s3_env(s3_server, inputs, monkeypatch):
    """The environment an S3 user sets, and the local files uploaded under s3://BUCKET/PREFIX/ (with boto3, not
    through the code under test)."""
    import boto3

    env = {**CREDENTIALS, "AWS_ENDPOINT_URL": s3_server}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    s3 = boto3.client("s3", endpoint_url=s3_server, **{k.lower(): v for k, v in CREDENTIALS.items()
                                                       if k != "AWS_DEFAULT_REGION"}, region_name="us-east-1")
    s3.create_bucket(Bucket=BUCKET)
    for p in inputs.iterdir():
        s3.put_object(Bucket=BUCKET, Key=f"{PREFIX}/{p.name}", Body=p.read_bytes())
    import fsspec

    fsspec.filesystem("s3").invalidate_cache()  # s3fs caches instances and listings per process
    return env


def rows(ref):
    kept = sorted(ref.read(["source_id", "doc_id", "text"]).to_pylist(), key=lambda r: r["doc_id"])
    rejected = sorted((r["reason"], r["source_id"].rsplit("/", 1)[-1]) for r in ref.read_rejected().to_pylist())
    return kept, rejected


def test_s3_inputs_give_the_rows_of_the_local_files(s3_env, inputs, tmp_path):
    patterns = [f"s3://{BUCKET}/{PREFIX}/*.jsonl*", f"s3://{BUCKET}/{PREFIX}/*.parquet"]
    raws = resolve_inputs(patterns)
    assert [r.path for r in raws] == [f"s3://{BUCKET}/{PREFIX}/{n}" for n in ("a.jsonl", "b.jsonl.gz", "c.parquet")]
    local = resolve_inputs([str(inputs / "*.jsonl*"), str(inputs / "*.parquet")])
    assert [(r.sha256, r.bytes) for r in raws] == [(r.sha256, r.bytes) for r in local]

    remote = run_collect(CollectConfig(inputs=patterns), str(tmp_path / "w-s3"))
    here = run_collect(CollectConfig(inputs=[str(inputs / "*.jsonl*"), str(inputs / "*.parquet")]), str(tmp_path / "w"))
    (kept_s3, rej_s3), (kept_local, rej_local) = rows(remote), rows(here)
    assert len(kept_local) == 24 and [r[0] for r in rej_local] == ["invalid_json"]
    # same texts and source ids; doc_ids of records without an `id` would differ only by their file's URL
    assert [(r["source_id"], r["text"]) for r in kept_s3] == [(r["source_id"], r["text"]) for r in kept_local]
    assert [r["doc_id"] for r in kept_s3] == [r["doc_id"] for r in kept_local]
    assert rej_s3 == rej_local
    assert [i["path"] for i in remote.manifest()["inputs"]][0] == f"s3://{BUCKET}/{PREFIX}/a.jsonl"  # lineage keeps the URL


def test_without_credentials_the_error_names_the_input_and_the_variables(s3_server, monkeypatch, tmp_path):
    from lifecycle.tasks.data.collect.stage import InputError

    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance-metadata lookup for credentials
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(k, raising=False)
    import fsspec

    fsspec.filesystem("s3").invalidate_cache()
    with pytest.raises(InputError, match=f"cannot list 's3://{BUCKET}/raw/\\*.jsonl'.*credentials.*AWS_ACCESS_KEY_ID"):
        resolve_inputs([f"s3://{BUCKET}/raw/*.jsonl"])


def test_lifecycle_run_collects_from_s3_with_credentials_from_the_environment(s3_env, tmp_path):
    """The whole command, as a user runs it: shard workers are other processes, and they read the environment."""
    wd = tmp_path / "w"
    env = {**os.environ, **s3_env}
    out = last_json(lifecycle("run", "--json", "--until", "collect", "--set", f"workdir={wd}",
                              "--set", f'collect.inputs=["s3://{BUCKET}/{PREFIX}/*.jsonl*"]', env=env).stdout)
    manifest = json.loads(open(out["datasets"]["collect"]).read())
    assert manifest["num_rows"] == 18 and [i["path"].rsplit("/", 1)[-1] for i in manifest["inputs"]] == \
        ["a.jsonl", "b.jsonl.gz"]
