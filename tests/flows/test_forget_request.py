"""A deletion request without training (runs in CI; the training routes are tests/flows/test_forget_e2e.py, slow):
the data stages of a real `lifecycle run` on a slice of the corpus plus a canary, then `lineage forget` (the exact
report), `lifecycle forget` (the tombstone), and a later incremental crawl that brings the canary back, with a near
copy: both are rejected at collect as `forgotten`, and no text of the canary is in the ledger, the new datasets,
MLflow (SQLite store and artifacts) or the command's output."""

import json
from pathlib import Path

import pytest

from lifecycle.core.dataset import DatasetRef
from tests.conftest import ROOT, corpus_records, last_json, lifecycle
from tests.flows.test_forget_e2e import CANARY, NEAR, file_leaks, leaks

pytestmark = pytest.mark.e2e

DATA = ["tokenize.vocab_size=512", "tokenize.val_fraction=0.2", "orchestration.retry_backoff_s=0.1"]
SID = "diary-fast"


def sets(wd: Path, inputs: list[str], extra=()) -> list[str]:
    out = ["--set", f"workdir={wd}", "--set", f"collect.inputs={json.dumps(inputs)}"]
    for s in [*DATA, *extra]:
        out += ["--set", s]
    return out


@pytest.fixture(scope="module")
def request_world(tmp_path_factory):
    inputs_dir, wd = tmp_path_factory.mktemp("forget-fast-in"), tmp_path_factory.mktemp("forget-fast-wd")
    with open(inputs_dir / "docs.jsonl", "w") as f:
        for r in corpus_records(12) + [{"id": SID, "text": CANARY}]:
            f.write(json.dumps(r) + "\n")
    inputs = [str(inputs_dir / "*.jsonl")]
    config = ROOT / "deploy/configs/demo.yaml"
    first = last_json(lifecycle("run", config, "--json", "--until", "tokenize", *sets(wd, inputs)).stdout)
    report = last_json(lifecycle("lineage", "forget", SID, "--workdir", wd, "--json").stdout)
    before = {p for p in (wd / "datasets").glob("*/*") if p.is_dir()}
    fg = lifecycle("forget", SID, "--reason", "erasure request 7", "--json", "--config", config, *sets(wd, inputs))
    (inputs_dir / "crawl2.jsonl").write_text(json.dumps({"id": "diary-recrawl", "text": CANARY}) + "\n"
                                             + json.dumps({"id": "diary-near", "text": NEAR}) + "\n"
                                             + json.dumps(corpus_records(14)[13]) + "\n")
    crawl = last_json(lifecycle("run", config, "--json", "--until", "collect",
                                *sets(wd, inputs, ["collect.incremental=true"])).stdout)
    return {"wd": wd, "first": first, "report": report, "forget": last_json(fg.stdout),
            "forget_out": fg.stdout + fg.stderr, "crawl": crawl,
            "new_datasets": {p for p in (wd / "datasets").glob("*/*") if p.is_dir()} - before}


def test_report_names_the_raw_record_derived_rows_and_token_range(request_world):
    r = request_world["report"]
    assert r["found_source_ids"] == [SID] and len(r["doc_ids"]) == 1
    (pos,) = r["raw_positions"]
    assert pos["raw_path"].endswith("docs.jsonl") and pos["record"] == 13  # the last line (records count from 1)
    raw = Path(pos["raw_path"]).read_bytes()[pos["byte_start"] : pos["byte_end"]]
    assert json.loads(raw) == {"id": SID, "text": CANARY}
    assert {d["stage"] for d in r["datasets"]} >= {"collect", "filter", "dedup", "scrub", "tokenize"}
    (tr,) = r["token_ranges"]
    assert tr["token_end"] > tr["token_start"] and tr["split"] in ("train", "val")
    assert r["model_versions"] == []  # the data stages only: no model holds it


def test_forget_records_a_tombstone_without_text(request_world):
    out = request_world["forget"]
    assert out["status"] == "recorded" and out["tainted_versions"] == []  # no model registered yet
    (t,) = out["tombstones"]
    assert t["source_id"] == SID and t["doc_id"] == request_world["report"]["doc_ids"][0]
    assert t["reason"] == "erasure request 7" and len(t["content_hash"]) == 64
    assert file_leaks(request_world["wd"] / "tombstones.parquet") == []
    assert leaks(request_world["forget_out"].encode()) == []


def test_recrawl_and_near_copy_rejected_as_forgotten_unrelated_kept(request_world):
    collect = DatasetRef.from_dir(Path(request_world["crawl"]["datasets"]["collect"]).parent)
    rej = {r["source_id"]: r for r in collect.read_rejected().to_pylist()}
    assert rej["diary-recrawl"]["reason"] == "forgotten" and "exact copy" in rej["diary-recrawl"]["detail"]
    assert rej["diary-near"]["reason"] == "forgotten" and "near copy" in rej["diary-near"]["detail"]
    assert {r["reason"] for r in rej.values()} == {"forgotten"}
    kept = set(collect.read(["source_id"]).column("source_id").to_pylist())
    assert corpus_records(14)[13]["id"] in kept and not kept & {SID, "diary-recrawl", "diary-near"}


def test_no_text_in_new_datasets_or_mlflow(request_world):
    wd = request_world["wd"]
    assert {p.parent.name for p in request_world["new_datasets"]} >= {"collect"}
    for d in request_world["new_datasets"]:
        for p in [p for p in d.rglob("*") if p.is_file()]:
            assert file_leaks(p) == [], p
    stores = [wd / "mlflow.db", *[p for p in (wd / "mlartifacts").rglob("*") if p.is_file()]]
    assert stores[0].is_file()
    for p in stores:
        assert file_leaks(p) == [], p
